"""What the GPU tier measures of a run: its loss curve against the CPU's, the allocator's peak beside
the planner's, and the steady tokens/s. Shared by tests/gpu's files (only run where CUDA is)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO, assert_ok, cli_env, curve, read_metrics, run_cli

def gpu_env(**extra: str) -> dict[str, str]:
    """A run's environment on the GPU (the CPU suite pins DeepSpeed's accelerator to cpu)."""
    return cli_env(DS_ACCELERATOR="cuda", **extra)


def loss_gap(got: list[dict], want: list[dict]) -> float:
    """Mean relative gap of the loss curve `got` to `want`, at the same logged steps."""
    g, w = curve(got, "loss"), curve(want, "loss")
    assert [s for s, _ in g] == [s for s, _ in w], "different logged steps"
    return sum(abs(a - b) / b for (_, a), (_, b) in zip(g, w)) / len(w)


def cpu_reference_run(run_dir: Path, args: list[str]) -> list[dict]:
    """The same run on the CPU, with no GPU visible: the reference curve."""
    assert_ok(run_cli([*args, f"hydra.run.dir={run_dir}"], env=cli_env(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")))
    return read_metrics(run_dir)


PEAK = """
import json, sys
from pathlib import Path
from megaframe.backends.registry import validate_for_engine
from megaframe.config.compose import compose
from megaframe.plan.estimate import estimate_config
from megaframe.tracking.metrics import read_metrics

cfg, _ = compose(sys.argv[2:])
planned = estimate_config(cfg, validate_for_engine(cfg, 1))
measured = max(r["memory_gb"] for r in read_metrics(Path(sys.argv[1]) / "metrics.jsonl") if "memory_gb" in r)
Path(sys.argv[1], "peak.json").write_text(json.dumps({"planned_gib": (planned.peak - planned.reserved) / 2**30,
                                                     "measured_gib": measured}))
"""
# a model big enough that its states and activations dominate the allocator's own rounding
PEAK_MODEL = ["model.num_layers=8", "model.hidden_size=1024", "model.num_attention_heads=16",
              "model.ffn_hidden_size=4096", "model.seq_length=512", "parallel.micro_batch_size=4",
              "parallel.global_batch_size=8", "train.max_steps=3", "train.log_interval=1", "train.eval_interval=0",
              "train.save_interval=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def planned_and_measured_peak(args: list[str], run_dir: Path, env: dict[str, str]) -> dict[str, float]:
    """Train `args` at one rank, then {planned_gib, measured_gib}: the planner's peak less what it
    reserves for the CUDA context (not in max_memory_allocated), and the allocator's."""
    assert_ok(run_cli([*args, f"hydra.run.dir={run_dir}"], env=env, timeout=900))
    result = subprocess.run([sys.executable, "-c", PEAK, str(run_dir), *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "peak.json").read_text())


def steady_tokens_per_s(args: list[str], run_dir: Path, env: dict[str, str], steps: int = 12) -> float:
    """Median tokens/s over the logged steps after the first third (compilation and warm-up)."""
    assert_ok(run_cli([*args, f"train.max_steps={steps}", "train.log_interval=1", f"hydra.run.dir={run_dir}"],
                      env=env, timeout=1500))
    rates = [r["tokens_per_s"] for r in read_metrics(run_dir) if "tokens_per_s" in r]
    return statistics.median(rates[len(rates) // 3:])
