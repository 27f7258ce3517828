"""Learning-rate schedule: linear warmup from 0, then cosine / linear decay to min_lr, or constant."""
from __future__ import annotations

import math

import torch

from megaframe.config.schema import OptimConfig


class LRFactor:
    """lr(step) / lr as a picklable callable, so LambdaLR state round-trips through checkpoints."""

    def __init__(self, optim: OptimConfig, max_steps: int):
        self.warmup = optim.warmup_steps
        self.decay = optim.lr_decay
        self.min_ratio = optim.min_lr / optim.lr
        self.max_steps = max_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            # (step + 1): the first update already moves the weights, unlike a warmup from exactly 0
            return (step + 1) / self.warmup
        if self.decay == "constant":
            return 1.0
        span = max(1, self.max_steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def lr_scheduler_factory(optim: OptimConfig, max_steps: int):
    """What deepspeed.initialize(lr_scheduler=...) accepts: optimizer -> scheduler."""
    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, LRFactor(optim, max_steps))
    return build
