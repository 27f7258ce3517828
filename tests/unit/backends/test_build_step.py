"""undo_build_step leaves every optimizer but DeepSpeed's FP16_UnfusedOptimizer alone: ZeRO's, the bf16
optimizer's and the plain fp32 one (torch's AdamW, Muon) take no step at build, so their state, made
by a real step or loaded from a checkpoint, is kept. The undo itself is checked through the real
engine in tests/dist/test_zero0_build_step.py."""
from __future__ import annotations

import torch

from megaframe.backends.deepspeed.build_step import undo_build_step


def test_an_optimizer_deepspeed_did_not_step_at_build_keeps_its_state():
    weight = torch.nn.Parameter(torch.ones(4))
    adam = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.1)
    weight.grad = torch.full((4,), 0.5)
    adam.step()
    stepped = weight.detach().clone()
    assert undo_build_step(adam) is False
    assert int(adam.state[weight]["step"]) == 1 and adam.state[weight]["exp_avg"].abs().sum() > 0
    assert torch.equal(weight.detach(), stepped)
