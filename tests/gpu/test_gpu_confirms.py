"""What only a real GPU can confirm beyond the CUDA-shaped CPU device (tests/fakecuda_tier): NCCL's
bf16 collectives under cp, SP, ep and pp; CUDA's own dropout kernels across a resume; the stream
syncs a step really makes (torch's CUDA sync debug mode sees each one, inside kernels too); and the
allocator's peak against the planner. Written on a CPU-only machine and not yet run on a GPU."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support.gpu_measure import PEAK_MODEL, planned_and_measured_peak
from tests.support.helpers import REPO, TINY, assert_ok, cli_env, curve, read_metrics, run_cli

STEPS = ["train.max_steps=20", "train.eval_interval=10"]
BF16_GAP = 2e-2  # mean relative loss gap between two bf16 runs that sum in different orders


def _env() -> dict[str, str]:
    return cli_env(DS_ACCELERATOR="cuda")


def _mean_gap(got: list[dict], want: list[dict]) -> float:
    g, w = curve(got, "loss"), curve(want, "loss")
    assert [s for s, _ in g] == [s for s, _ in w] and w, "different logged steps"
    return sum(abs(a - b) / b for (_, a), (_, b) in zip(g, w)) / len(w)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@two_gpus
@pytest.mark.parametrize("layout", [
    ["model=llama_tiny", "model.num_kv_heads=2", "parallel.cp=2"],  # ring blocks through FlashAttention-2
    ["parallel.tp=2", "parallel.sequence_parallel=true"],
    ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "zero=stage1"],  # grouped GEMM in bf16 + all-to-all
    ["parallel.pp=2", "model.num_layers=4", "zero=stage1"],
    # FSDP2's pipeline: torch's zero-bubble V schedule, its P2P and the tied embedding's all-reduce on NCCL
    ["backend=fsdp2", "zero=stage2", "parallel.pp=2", "model.num_layers=4", "parallel.pipeline_schedule=zbv"],
], ids=["cp2-ring", "tp2-sp", "ep2", "pp2", "fsdp2-pp2-zbv"])
def test_two_gpus_in_bf16_stay_within_bf16_of_one(layout, tmp_path):
    model = [a for a in layout if a.startswith("model")]
    common = [*TINY, *STEPS, "precision=bf16"]
    assert_ok(run_cli([*common, *model, "zero=stage1", f"hydra.run.dir={tmp_path / 'one'}"], env=_env(), timeout=900))
    assert_ok(run_cli([*common, *layout, f"hydra.run.dir={tmp_path / 'two'}"], env=_env(), timeout=900))
    gap = _mean_gap(read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one"))
    print(f"{layout}: mean relative bf16 loss gap to one GPU {gap:.2e}")
    assert gap < BF16_GAP, (layout, gap)


def test_a_dropout_resume_continues_the_uninterrupted_curve(tmp_path):
    """Dropout outside TP regions draws from CUDA's generator: its state travels in the checkpoint."""
    args = [*TINY, "train.max_steps=12", "train.save_interval=6", "model.dropout=0.1", "zero=stage1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert_ok(run_cli([*args, f"hydra.run.dir={whole}"], env=_env(), timeout=900))
    assert_ok(run_cli([*args, "train.exit_at_step=6", f"hydra.run.dir={resumed}"], env=_env(), timeout=900))
    assert_ok(run_cli([*args, f"hydra.run.dir={resumed}"], env=_env(), timeout=900))
    got, want = curve(read_metrics(resumed), "loss"), curve(read_metrics(whole), "loss")
    assert [s for s, _ in got] == [s for s, _ in want]
    for (step, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5), (step, a, b)


SYNCS = """
import json, sys, warnings
from pathlib import Path
import torch
from megaframe.config.compose import compose
from megaframe.config.validate import validate
from megaframe.training.trainer import Trainer

counts = {}
for micro in (1, 4):
    cfg, _ = compose([*sys.argv[2:], f"parallel.global_batch_size={2 * micro}", "train.eval_interval=0"])
    with Trainer(cfg, validate(cfg, 1), Path(sys.argv[1]) / str(micro)) as trainer:
        trainer.train_step()  # the first step: lazy optimizer state, one-off reads
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")  # a warning at every call that waits for the stream
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts[micro] = sum("synchroniz" in str(w.message) for w in seen)
Path(sys.argv[1], "syncs.json").write_text(json.dumps(counts))
"""


@pytest.mark.parametrize("extra", [["zero=stage1", "precision=bf16"], ["zero=stage0"],
                                   ["model=moe_tiny", "zero=stage1", "precision=bf16"]],
                         ids=["zero1-bf16", "zero0-fp32", "moe-bf16"])
def test_a_step_syncs_the_stream_as_often_with_four_micro_batches_as_with_one(extra, tmp_path):
    """CUDA's own count of the syncs in one step (the CPU tier counts the same calls by name)."""
    result = subprocess.run([sys.executable, "-c", SYNCS, str(tmp_path), *TINY, *extra], cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads((tmp_path / "syncs.json").read_text())
    print(f"{extra}: stream syncs per step {counts}")
    assert counts["1"] == counts["4"] and counts["1"] > 0, counts


@pytest.mark.parametrize("extra", [["zero=stage1", "precision=bf16"], ["zero=stage1"],
                                   ["zero=stage1", "precision=bf16", "parallel.activation_checkpointing=true"]],
                         ids=["bf16", "fp32", "bf16-recompute"])
def test_the_allocators_peak_is_within_ten_percent_of_the_planner(extra, tmp_path):
    """The planner's peak less what it reserves for the CUDA context (not in max_memory_allocated)."""
    peak = planned_and_measured_peak([*PEAK_MODEL, *extra], tmp_path, _env())
    print(f"{extra}: planned {peak['planned_gib']:.3f} GiB, measured {peak['measured_gib']:.3f} GiB")
    assert abs(peak["measured_gib"] - peak["planned_gib"]) <= 0.1 * peak["planned_gib"], peak
