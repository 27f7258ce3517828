"""megaframe-train on the CUDA-shaped device (tests/fakecuda): as a user runs it on GPUs (DeepSpeed on a
`cuda` accelerator, every tensor of the step loop on cuda:N, collectives refusing host tensors), with
no change to megaframe. Each run must finish with no violation in any process and the plain CPU
run's curve (loss, gradient norm, eval loss at rtol 1e-5 in fp32). The ranks start as the e2e tests
start them (python -m megaframe.train, self-launched through torchrun for dp=2), each installing the
device from tests/fakecuda/sitecustomize.py."""
from __future__ import annotations

import time

import pytest

from fakecuda.env import fake_cuda_env
from helpers import TINY, assert_ok, curve, read_metrics, run_cli
from parity import assert_parity

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=6", "train.eval_interval=3"]


def run_on_device(tmp_path, name: str, extra: list[str], world: int = 1, kernels: tuple[str, ...] = (),
                  **env: str) -> list[dict]:
    """Train under the tier; return the run's metrics after checking every process's report (and that
    each rank ran the emulated CUDA kernels named in `kernels`)."""
    from fakecuda.ledger import read_reports

    run_dir, reports = tmp_path / name, tmp_path / f"{name}-reports-{time.monotonic_ns()}"  # one per run
    result = run_cli([*TINY, *STEPS, *extra, f"hydra.run.dir={run_dir}"], env=fake_cuda_env(reports, **env))
    assert_ok(result)
    assert "| device cuda:0 (NVIDIA H100" in result.stdout, result.stdout[-2000:]
    ranks = [r for r in read_reports(reports) if "megaframe" in " ".join(r["argv"])]
    trained = [r for r in ranks if r["rank"] is not None]
    assert len(trained) == world, f"{name}: {len(trained)} rank reports for {world} ranks: {ranks}"
    for report in ranks:
        assert report["violations"] == [], f"{name}: rank {report['rank']}: {report['violations']}"
    assert all(any(kind == "item" for kind, _, _ in r["syncs"]) for r in trained), "no host read counted at all"
    for r in trained:
        assert all(r["kernels"].get(f"aten.{k}.default") for k in kernels), (kernels, r["kernels"])
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("cpu") / "run"
    assert_ok(run_cli([*TINY, *STEPS, f"hydra.run.dir={run_dir}"]))
    return read_metrics(run_dir)


SINGLE = {"zero0-fp32": ["zero=stage0"], "zero1-fp32": ["zero=stage1"], "zero2-fp32": ["zero=stage2"]}


@pytest.mark.parametrize("case", list(SINGLE))
def test_one_rank_trains_on_the_device_with_the_cpu_curve(case, cpu_reference, tmp_path):
    # fp32 attention: CUDA's memory-efficient kernel (its contract emulated by tests/fakecuda/kernels.py)
    metrics = run_on_device(tmp_path, case, SINGLE[case], kernels=("_scaled_dot_product_efficient_attention",
                                                                   "_scaled_dot_product_efficient_attention_backward"))
    assert_parity(metrics, cpu_reference, f"fakecuda {case}")


def test_deepspeed_synchronized_device_paths_too(cpu_reference, tmp_path):
    """is_synchronized_device() True: DeepSpeed's CPU code paths (no reduction stream) on the same device."""
    metrics = run_on_device(tmp_path, "zero2-sync", ["zero=stage2"], MEGAFRAME_FAKE_CUDA_SYNCHRONIZED="1")
    assert_parity(metrics, cpu_reference, "fakecuda zero2 synchronized")


TWO_RANKS = {"dp2-zero1": ["parallel.dp=2", "zero=stage1"], "dp2-zero3": ["parallel.dp=2", "zero=stage3"],
             "tp2-zero1": ["parallel.tp=2", "zero=stage1"], "pp2-zero1": ["parallel.pp=2", "zero=stage1"]}


@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_two_ranks_train_on_the_device_with_the_cpu_curve(case, cpu_reference, tmp_path):
    metrics = run_on_device(tmp_path, case, TWO_RANKS[case], world=2)
    assert_parity(metrics, cpu_reference, f"fakecuda {case}")


def test_bf16_trains_through_the_flash_attention_kernel_close_to_the_cpu(tmp_path):
    """bf16 attention goes through FlashAttention-2's contract (tests/fakecuda/kernels.py, computed by the
    CPU's flash kernel); held to bf16 rounding, not bit for bit, as a real GPU's kernels differ."""
    extra = ["zero=stage1", "precision=bf16"]
    assert_ok(run_cli([*TINY, *STEPS, *extra, f"hydra.run.dir={tmp_path / 'cpu'}"]))
    metrics = run_on_device(tmp_path, "bf16-zero1", extra, kernels=("_scaled_dot_product_flash_attention",
                                                                     "_scaled_dot_product_flash_attention_backward"))
    for key in ("loss", "eval_loss"):
        got, want = curve(metrics, key), curve(read_metrics(tmp_path / "cpu"), key)
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 2
        for (step, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, rel=1e-3), f"bf16 {key} at step {step}: {a} vs CPU {b}"


def test_resume_on_the_device_continues_the_cpu_curve(cpu_reference, tmp_path):
    """Stopped at step 3 and resumed from its layout-free checkpoint: optimizer state (Adam's step too,
    which fused AdamW reads on the device) comes back onto the device."""
    extra = ["zero=stage1", "train.save_interval=3"]
    run_on_device(tmp_path, "resume", [*extra, "train.exit_at_step=3"])
    assert_parity(run_on_device(tmp_path, "resume", extra), cpu_reference, "fakecuda resumed zero1")
