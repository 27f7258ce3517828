"""More layouts on the CUDA-shaped device (tests/support/fakecuda): context parallelism with the ring's blocks
through FlashAttention-2's contract in bf16, expert parallelism with the grouped GEMM in bf16, the
pipeline in bf16, and a
dropout resume, whose masks outside TP regions come from the device's generator (a checkpoint that
kept only the CPU's left the curve). Each run: no violation in any process; bf16 runs within bf16
rounding of the CPU's bf16 curve, the resume on the uninterrupted device curve at rtol 1e-5. (tp2
with SP and Ulysses: test_training_two_ranks.py; CPU offload, async save, resumes at ZeRO-0/3,
DeepSpeed's native checkpoint and HF export: test_checkpoints_and_offload.py; the bench's CUDA mode:
test_bench_cuda_mode.py. fp16 and recomputation ran on the device by hand with no violation; CI time
keeps them out of the suite.)"""
from __future__ import annotations

from collections import Counter

import pytest

from tests.support.fakecuda.ledger import read_reports
from tests.support.fakecuda.runs import assert_curves_within, cpu_run, run_on_device
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
LLAMA = ["model=llama_tiny", "model.num_kv_heads=2"]
FLASH = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")


def _within_bf16(got: list[dict], want: list[dict], what: str) -> None:
    assert_curves_within(got, want, 2e-3, f"{what} (bf16)")


def test_the_ring_in_bf16_runs_its_blocks_through_flash_attention(tmp_path):
    extra = [*LLAMA, "parallel.cp=2", "zero=stage1", "precision=bf16"]
    cpu = cpu_run(tmp_path, extra)
    _within_bf16(run_on_device(tmp_path, "cp2-ring-bf16", extra, world=2, kernels=FLASH), cpu, "cp2 ring bf16")


def test_experts_over_two_ranks_in_bf16_through_the_grouped_gemm(tmp_path):
    extra = ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "zero=stage1", "precision=bf16"]
    cpu = cpu_run(tmp_path, extra)
    _within_bf16(run_on_device(tmp_path, "ep2-bf16", extra, world=2, kernels=("_grouped_mm",)), cpu, "ep2 bf16")


def _blocking_uploads(tmp_path, name: str) -> Counter:
    """Host-to-device copies the host waited for (ledger: not non_blocking from pinned memory), by
    (rank, call site), over the run."""
    waited: Counter = Counter()
    for folder in tmp_path.glob(f"{name}-reports-*"):
        for report in read_reports(folder):
            if report["rank"] is not None:
                waited.update({(report["rank"], site): n for kind, site, n in report["syncs"]
                               if kind == "blocking upload"})
    return waited


def test_the_pipeline_in_bf16_trains_its_stages_on_the_device(tmp_path):
    """pp2 in bf16: DeepSpeed's pipeline engine with its bf16 optimizer, activations sent between the
    stages as device tensors (pp2 in fp32: test_training_two_ranks.py). The host waits on no upload
    per micro-batch: twice the micro-batches per step, the same blocking uploads (DeepSpeed's stages
    loaded each micro-batch's inputs and targets from pageable memory, a stream sync on a GPU)."""
    extra = ["parallel.pp=2", "zero=stage1", "precision=bf16"]
    cpu = cpu_run(tmp_path, extra)
    _within_bf16(run_on_device(tmp_path, "pp2-bf16", extra, world=2), cpu, "pp2 bf16")
    run_on_device(tmp_path, "pp2-bf16-8-micro", [*extra, "parallel.global_batch_size=16"], world=2)
    four, eight = _blocking_uploads(tmp_path, "pp2-bf16"), _blocking_uploads(tmp_path, "pp2-bf16-8-micro")
    assert four, "no blocking upload counted at all (DeepSpeed's start-up makes some): the counting is broken"
    assert eight == four, (eight - four, four - eight)


def test_a_dropout_resume_continues_the_uninterrupted_device_curve(tmp_path):
    """Dropout outside TP regions draws from the device's generator: the checkpoint carries its state."""
    extra = ["model.dropout=0.1", "zero=stage1", "train.save_interval=3"]
    whole = run_on_device(tmp_path, "whole", extra)
    run_on_device(tmp_path, "parts", [*extra, "train.exit_at_step=3"])
    resumed = run_on_device(tmp_path, "parts", extra)
    assert_parity(resumed, whole, "fakecuda dropout resume")
