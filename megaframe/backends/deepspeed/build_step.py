"""Undo the optimizer step DeepSpeed's fp16/bf16 ZeRO-0 optimizer takes when it is built.

precision=bf16|fp16 at zero=stage0 without a pipeline (and fp16 with one) wraps torch's AdamW in
DeepSpeed's FP16_UnfusedOptimizer, whose constructor (initialize_optimizer_states) gives every
fp32 master a zero gradient and calls the inner optimizer's step() once, to create Adam's state
eagerly. That step is not training: AdamW counts it (its bias correction then starts from step 2,
so the first real update is ~0.73x the learning rate) and applies weight decay once to the fp32
masters (not to the module's bf16/fp16 weights, which it does not copy back). The run then follows
another curve than fp32 or ZeRO-1 (1.2% off after four steps of the tiny model).

Undone once, right after deepspeed.initialize and before any checkpoint load: the inner optimizer's
per-parameter state is dropped (torch's Adam and AdamW, fused or not, recreate step, exp_avg and
exp_avg_sq at their first step), and each master is set back to its module weight, of which it was
an exact fp32 copy before that step. A resumed run loads its state afterwards, so it keeps it.
"""
from __future__ import annotations

from typing import Any

import torch


def undo_build_step(optimizer: Any) -> bool:
    """Undo the zero-gradient step of a freshly built FP16_UnfusedOptimizer (the only optimizer
    megaframe's ZeRO-0 mixed-precision configs build: its fused sibling FP16_Optimizer wraps
    DeepSpeed's FusedAdam, which ds_config.py never selects). Returns whether there was one."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return False  # ZeRO's, BF16_Optimizer and the plain fp32 optimizer take no step at build
    optimizer.optimizer.state.clear()
    with torch.no_grad():
        for weights, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            if masters:
                torch._foreach_copy_(masters, weights)  # casts to fp32: the masters' values before that step
    return True
