"""precision=fp8 on the CUDA-shaped device (tests/support/fakecuda) as on an H100: precision.fp8.emulate
left at auto computes with fp8 kernels there (torch._scaled_mm, its cuBLASLt contract checked by the
tier: fp8 operands, row- and column-major layouts, multiples of 16, fp32 scales on the device), at
dp=2 ZeRO-1 and tp=2, each with no violation in any process and on the plain CPU run's curve: the same
layout on CPU ranks with emulate=false, the CPU's _scaled_mm kernel (the same arithmetic: rtol 1e-5). The host-sync budget of fp8
(tests/fakecuda_tier/test_host_sync_budget.py) says its step reads the host no more than bf16's."""
from __future__ import annotations

import pytest

from tests.support.fakecuda.runs import cpu_run, run_on_device
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
# both kinds of scale of fp8 tensor cores below SM 10.0 (MXFP8's need Blackwell), one layout each: the
# rowwise one at tp=2, where its grad-input scales run along the split dimension
LAYOUTS = {"dp2-zero1-tensorwise": ["parallel.dp=2", "zero=stage1", "precision.fp8.recipe=tensorwise"],
           "tp2-zero1-rowwise": ["parallel.tp=2", "zero=stage1", "precision.fp8.recipe=rowwise"]}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_fp8_kernels_train_on_the_device_with_the_cpu_curve(case, tmp_path):
    fp8 = ["precision=fp8", *LAYOUTS[case]]
    (tmp_path / "cpu").mkdir()
    reference = cpu_run(tmp_path / "cpu", [*fp8, "precision.fp8.emulate=false"])
    metrics = run_on_device(tmp_path, case, fp8, world=2, kernels=("_scaled_mm",))
    assert_parity(metrics, reference, f"fakecuda fp8 {case}")
