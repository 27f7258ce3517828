"""megaframe-train on the CUDA-shaped device (tests/support/fakecuda): as a user runs it on GPUs (DeepSpeed on a
`cuda` accelerator, every tensor of the step loop on cuda:N, collectives refusing host tensors), with
no change to megaframe. Each run must finish with no violation in any process and the plain CPU
run's curve (loss, gradient norm, eval loss at rtol 1e-5 in fp32). The ranks start as the e2e tests
start them (python -m megaframe.train, self-launched through torchrun for two ranks), each installing
the device from tests/support/fakecuda/sitecustomize.py. This file: one rank."""
from __future__ import annotations

import pytest

from tests.support.fakecuda.runs import cpu_run, run_on_device
from tests.support.helpers import curve
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
SINGLE = {"zero0-fp32": ["zero=stage0"], "zero1-fp32": ["zero=stage1"], "zero2-fp32": ["zero=stage2"]}


@pytest.mark.parametrize("case", list(SINGLE))
def test_one_rank_trains_on_the_device_with_the_cpu_curve(case, cpu_reference, tmp_path):
    # fp32 attention: CUDA's memory-efficient kernel (its contract emulated by tests/support/fakecuda/kernels.py)
    metrics = run_on_device(tmp_path, case, SINGLE[case], kernels=("_scaled_dot_product_efficient_attention",
                                                                   "_scaled_dot_product_efficient_attention_backward"))
    assert_parity(metrics, cpu_reference, f"fakecuda {case}")


def test_deepspeed_synchronized_device_paths_too(cpu_reference, tmp_path):
    """is_synchronized_device() True: DeepSpeed's CPU code paths (no reduction stream) on the same device."""
    metrics = run_on_device(tmp_path, "zero2-sync", ["zero=stage2"], MEGAFRAME_FAKE_CUDA_SYNCHRONIZED="1")
    assert_parity(metrics, cpu_reference, "fakecuda zero2 synchronized")


def test_bf16_trains_through_the_flash_attention_kernel_close_to_the_cpu(tmp_path):
    """bf16 attention goes through FlashAttention-2's contract (tests/support/fakecuda/kernels.py, computed by the
    CPU's flash kernel); held to bf16 rounding, not bit for bit, as a real GPU's kernels differ."""
    extra = ["zero=stage1", "precision=bf16"]
    cpu = cpu_run(tmp_path, extra)
    metrics = run_on_device(tmp_path, "bf16-zero1", extra, kernels=("_scaled_dot_product_flash_attention",
                                                                     "_scaled_dot_product_flash_attention_backward"))
    for key in ("loss", "eval_loss"):
        got, want = curve(metrics, key), curve(cpu, key)
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 2
        for (step, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, rel=1e-3), f"bf16 {key} at step {step}: {a} vs CPU {b}"


def test_resume_on_the_device_continues_the_cpu_curve(cpu_reference, tmp_path):
    """Stopped at step 3 and resumed from its layout-free checkpoint: optimizer state (Adam's step too,
    which fused AdamW reads on the device) comes back onto the device."""
    extra = ["zero=stage1", "train.save_interval=3"]
    run_on_device(tmp_path, "resume", [*extra, "train.exit_at_step=3"])
    assert_parity(run_on_device(tmp_path, "resume", extra), cpu_reference, "fakecuda resumed zero1")
