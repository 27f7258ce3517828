"""Helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A model and schedule small enough for multi-rank runs on two cores; every run logs every step.
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
    "model.seq_length=32", "parallel.micro_batch_size=2", "parallel.global_batch_size=8",
    "train.log_interval=1", "train.eval_interval=3", "train.eval_steps=1", "train.save_interval=0",
    "optim.warmup_steps=2", "logging.wandb.mode=disabled", "logging.progress_bar=false",
]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment a subprocess run gets: no inherited launcher variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID", "LOCAL_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_cli(args: list[str], *, launcher: list[str] | None = None, cwd: Path | None = None,
            env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m megaframe.train ARGS` (optionally under a launcher command), capturing output."""
    cmd = [sys.executable, *(launcher or []), "-m", "megaframe.train", *args]
    return subprocess.run(cmd, cwd=cwd or REPO, env=env or cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    """Records of RUN_DIR/metrics.jsonl."""
    from megaframe.tracking.metrics import read_metrics as read_file

    return read_file(Path(run_dir) / "metrics.jsonl")


def curve(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) for every record that carries `key`."""
    return [(r["step"], r[key]) for r in records if key in r]


def assert_ok(result: subprocess.CompletedProcess) -> None:
    """Fail with the run's output when it did not exit 0."""
    assert result.returncode == 0, f"exit {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"


def run_preprocess_tool(*args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run tools/preprocess_data.py as a user would, in a fresh interpreter that must find megaframe
    on its own."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    environment.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), *map(str, args)],
                          cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)
