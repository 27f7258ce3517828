"""The ZeRO-0 fp32 gradient norm we measure ourselves must agree with DeepSpeed's fp64 norm (the
other stages report that one), so curves stay comparable across ZeRO stages."""
from __future__ import annotations

import pytest
import torch

from megaframe.engine.trainer import grad_norm
from megaframe.parallel.state import ParallelState


def test_grad_norm_matches_the_fp64_norm_on_a_wide_dynamic_range():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 384, bias=True), torch.nn.Linear(384, 16, bias=False))
    for p in model.parameters():
        # rows spanning many orders of magnitude, like an embedding gradient: fp32 lane-wise
        # accumulation (torch's CPU norm) is ~1e-5 off here
        p.grad = torch.randn_like(p) * torch.rand(p.shape[0], *[1] * (p.dim() - 1)) ** 8
    exact = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]).norm().item()
    assert abs(grad_norm(model, ParallelState(1, 1, 1, rank=0)) - exact) <= 1e-6 * exact


def test_grad_norm_skips_parameters_without_gradients():
    model = torch.nn.Linear(4, 3)
    model.weight.grad = torch.full((3, 4), 2.0)
    assert grad_norm(model, ParallelState(1, 1, 1, rank=0)) == pytest.approx(48 ** 0.5, rel=1e-12)
