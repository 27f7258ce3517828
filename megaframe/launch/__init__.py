"""Everything before a rank trains: megaframe-train's argv (main.py), the checks before launch
(checks.py), the launcher plug (registry.py: local, torchrun, slurm, ray; elastic a mode of each),
sweeps (sweep.py) and Hydra's run (hydra_run.py). The top floor: only the entry points import it
(tests/unit/test_architecture.py). The launcher group's config rules are config/launcher_rules.py."""
