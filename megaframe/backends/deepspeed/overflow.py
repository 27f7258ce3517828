"""One host read per step for the mixed-precision ZeRO-0 optimizer's overflow check.

precision=bf16|fp16 at zero=stage0 runs DeepSpeed's FP16_UnfusedOptimizer. Its CheckOverflow tests the
gradients one parameter at a time with `if has_inf_or_nan(grad)`: each test turns a device scalar
into a Python bool, so a step waits for the GPU once per parameter tensor (hundreds per step at
the recipes' depths). Here the per-tensor flags stay on the device, are combined with one
`any`, and reach the host once; DeepSpeed's reductions of the flag across ranks are unchanged.
"""
from __future__ import annotations

from typing import Any

import torch


def batch_overflow_check(optimizer: Any) -> bool:
    """Give an FP16_UnfusedOptimizer's overflow checker a per-step (not per-parameter) host read.
    Returns whether there was one to change."""
    checker = getattr(optimizer, "overflow_checker", None)
    if checker is None or not hasattr(checker, "has_overflow_serial"):
        return False
    from deepspeed.runtime.utils import has_inf_or_nan

    def has_overflow_serial(params) -> bool:
        flags = [has_inf_or_nan(p.grad.data) for p in params if p.grad is not None]
        return bool(torch.stack(flags).any()) if flags else False

    checker.has_overflow_serial = has_overflow_serial
    return True
