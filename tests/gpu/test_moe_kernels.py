"""The MoE layer's grouped GEMM on CUDA (torch._grouped_mm, bf16 on sm90 and sm100) against the
loop over experts it replaces, forward and backward. Not yet run on a GPU."""
from __future__ import annotations

import pytest
import torch

from megaframe.model import moe


def test_grouped_gemm_equals_the_loop_over_experts(monkeypatch):
    if torch.cuda.get_device_capability()[0] not in moe._GROUPED_MM_MAJORS:
        pytest.skip("torch._grouped_mm runs one kernel on sm90 and sm100; this GPU takes the loop")
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([5, 0, 17, 8], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    weight = torch.randn(4, 96, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    assert moe._grouped_mm_works(x, 96, 64)
    assert not moe._grouped_mm_works(x, 100, 64)  # 200 bytes: not a multiple of 16, the loop runs
    grouped = moe.grouped_linear(x, weight, counts)
    grouped.float().square().sum().backward()
    grads = x.grad.clone(), weight.grad.clone()
    x.grad, weight.grad = None, None
    monkeypatch.setattr(moe, "_grouped_mm_works", lambda *args: False)
    looped = moe.grouped_linear(x, weight, counts)
    looped.float().square().sum().backward()
    torch.testing.assert_close(grouped, looped, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0], x.grad, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(grads[1], weight.grad, rtol=2e-2, atol=2e-1)
