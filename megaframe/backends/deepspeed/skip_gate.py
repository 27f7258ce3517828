"""Skipping an update before it happens, through the path DeepSpeed already has for overflows.

DeepSpeed's ZeRO-1/2/3 and bf16 optimizers skip a step whose global gradient norm is not finite
(they zero the gradients, leave weights and moments alone, count engine.skipped_steps and hold the
LR schedule). Two pieces make that path cover everything we want to skip:
- ZeRO-0 in fp32 has no such check (a plain torch optimizer): `gate_plain_optimizer` adds it where
  the norm is measured anyway;
- a skip decided from the loss (a spike) poisons the last micro-batch's gradient with NaN through an
  identity-forward autograd function, so the norm every rank computes is non-finite and every rank
  skips together, in every ZeRO stage and pipeline schedule, without touching optimizer internals.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch


class _PoisonGradients(torch.autograd.Function):
    """Forward: the loss unchanged (it is still logged). Backward: NaN gradients."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


def poison_gradients(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, whose backward makes every gradient it reaches NaN."""
    return _PoisonGradients.apply(loss)


class LastMicroBatchGate:
    """Sums one step's micro-batch losses on the device. With skip_if, at the last one it asks
    skip_if with the global mean (one host read, before the update) and poisons that micro-batch's
    gradient when told to skip; without, the mean is read once, after the step (mean())."""

    def __init__(self, micro_batches: int, global_mean: Callable[[torch.Tensor], float],
                 skip_if: Optional[Callable[[float], bool]] = None):
        self.micro_batches, self.global_mean, self.skip_if = micro_batches, global_mean, skip_if
        self.total: Optional[torch.Tensor] = None
        self.seen = 0
        self._mean: Optional[float] = None

    def __call__(self, micro_loss: torch.Tensor) -> torch.Tensor:
        detached = micro_loss.detach().to(torch.float64)
        self.total = detached if self.total is None else self.total + detached
        self.seen += 1
        if self.skip_if is None or self.seen < self.micro_batches:
            return micro_loss
        self._mean = self.global_mean(self.total / self.micro_batches)
        return poison_gradients(micro_loss) if self.skip_if(self._mean) else micro_loss

    def mean(self) -> float:
        """The global batch's mean loss (read on the host once per step)."""
        if self._mean is None:
            self._mean = self.global_mean(self.total / self.micro_batches)
        return self._mean


def gate_plain_optimizer(optimizer: torch.optim.Optimizer, norm: float) -> None:
    """For DeepSpeed's _take_model_step at ZeRO-0 fp32: a non-finite norm skips the update.

    Dropping the gradients makes step() pass over every parameter (torch's optimizers, and
    DeepSpeed's FusedAdam, skip a parameter without .grad: no moment update, no weight decay, no
    step count); the engine then reads optimizer.overflow (skipped_steps, LR schedule held)."""
    optimizer.overflow = not math.isfinite(norm)
    if optimizer.overflow:
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
