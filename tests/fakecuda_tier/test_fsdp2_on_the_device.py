"""backend=fsdp2 on the CUDA-shaped device (tests/support/fakecuda): its DTensors hold device tensors, its
collectives refuse host tensors (as NCCL does), and every run must end with no violation in any
process and the plain CPU run's curve (rtol 1e-5, fp32). CPU offload is the case that puts host
tensors next to the device's: the gradient norm's sums must meet on the device."""
from __future__ import annotations

import pytest

from tests.support.fakecuda.runs import cpu_run, run_on_device
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
CASES = {"one-rank-stage3": (1, ["zero=stage3"]),
         "dp2-stage3-cpu-offload": (2, ["parallel.dp=2", "zero=stage3", "offload=cpu"]),
         "tp2-sp-stage2": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "zero=stage2"]),
         # torch's pipeline schedule: stages pass device tensors point to point, the losses meet on the device
         "pp2-1f1b-stage3": (2, ["parallel.pp=2", "zero=stage3"])}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_trains_on_the_device_with_the_cpu_curve(case, cpu_reference, tmp_path):
    world, extra = CASES[case]
    metrics = run_on_device(tmp_path, case, ["backend=fsdp2", *extra], world=world)
    assert_parity(metrics, cpu_reference, f"fakecuda fsdp2 {case}")


def test_moe_stages_train_on_the_device_with_the_cpu_curve(tmp_path):
    """Mixture-of-Experts blocks in torch's pipeline: each stage's router losses attached to its output
    and its router metrics summed on the device; the same layout's CPU run is the curve."""
    extra = ["backend=fsdp2", "model=moe_tiny", "parallel.pp=2", "zero=stage3"]
    assert_parity(run_on_device(tmp_path, "pp2-moe", extra, world=2), cpu_run(tmp_path, extra), "fakecuda fsdp2 pp2 moe")
