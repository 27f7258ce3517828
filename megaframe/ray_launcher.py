"""launcher=ray: the trainer in Ray Train's TorchTrainer workers, one per rank.

Ray Train starts the workers, sets up their process group (gloo, or NCCL with GPUs) and their
RANK/WORLD_SIZE/LOCAL_RANK; each worker then runs megaframe-train's own path as a launched rank,
into one run directory (rank 0's, passed explicitly). FailureConfig(max_failures) restarts the
whole worker group after a failure, and train.resume=auto makes each new attempt continue from
the run's last checkpoint. Ray is an optional extra: `pip install "megaframe[ray]"`.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

from megaframe.config.schema import TrainConfig

MISSING = 'launcher=ray needs Ray Train, which is not installed: pip install "megaframe[ray]"'


def ray_missing() -> bool:
    return importlib.util.find_spec("ray") is None


def run_on_ray(cfg: TrainConfig, world_size: int, overrides: list[str], run_dir: Path,
               entry: Callable[[list[str]], None]) -> int:
    """Train on `world_size` Ray workers, each calling entry(argv) (megaframe-train's main, passed in
    by the CLI); 0 when the run finished, else the failed attempt's exit code (1 when Ray reports an
    error without one)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from megaframe.slurm import task_overrides

    launcher = cfg.launcher
    if not ray.is_initialized():
        # the workers see the driver's megaframe, W&B and thread settings, also on a remote cluster
        passed = {k: v for k, v in os.environ.items() if k.startswith(("MEGAFRAME_", "WANDB_")) or k == "OMP_NUM_THREADS"}
        ray.init(address=launcher.ray_address, include_dashboard=False, runtime_env={"env_vars": passed})
    resources = {"CPU": launcher.cpus_per_worker, **({"GPU": launcher.gpus_per_worker} if launcher.gpus_per_worker else {})}
    trainer = TorchTrainer(
        _worker, train_loop_config={"overrides": task_overrides(overrides), "run_dir": str(run_dir), "entry": entry},
        torch_config=TorchConfig(backend="nccl" if launcher.gpus_per_worker else "gloo"),
        scaling_config=ScalingConfig(num_workers=world_size, use_gpu=bool(launcher.gpus_per_worker),
                                     resources_per_worker=resources),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir / "ray"),
                             failure_config=FailureConfig(max_failures=launcher.max_failures)))
    result = trainer.fit()
    return 0 if result.error is None else _exit_code(result.error)


def _exit_code(error: BaseException) -> int:
    """The exit code a worker's SystemExit carried, found in Ray's wrapped error chain."""
    seen = error
    while seen is not None:
        if isinstance(seen, SystemExit) and isinstance(seen.code, int):
            return seen.code
        seen = seen.__cause__ or seen.__context__
    return 1


def _worker(config: dict) -> None:
    """One rank: megaframe-train's launched-rank path, in Ray's process group."""
    config["entry"]([*config["overrides"], f"hydra.run.dir={config['run_dir']}"])
