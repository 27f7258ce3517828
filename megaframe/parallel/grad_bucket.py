"""Gradients of TP-replicated parameters used on per-rank data, summed over TP once per step.

Under sequence parallelism every TP rank applies the same norm gains and row-parallel biases to a
different sequence shard (and, when tp exceeds the kv heads, the same kv projection to different
heads), so their gradients must be summed over the TP group. An autograd all-reduce at every use
costs 2-6 collectives per layer per micro-batch. Megatron instead sums them after the backward pass,
in one bucket: this does the same. Each use's gradient contribution is stashed (the parameter gets
zeros from it), accumulated over the step's micro-batches in one flat fp32 buffer, and at the
accumulation boundary, still inside the last backward pass and so before the engine reads any
gradient, all-reduced over TP in one call and added to the parameters' .grad.

That last point limits where it applies: an engine that consumes each gradient inside the backward
pass (DeepSpeed ZeRO-2/3's reduce hooks) would read it before the sum; the backend uses a bucket only
where gradients stay in .grad until the boundary, and the per-use autograd sum elsewhere.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaframe.common.compile_breaks import run_eagerly

class _Stash(torch.autograd.Function):
    """Forward: the parameter. Backward: its gradient contribution goes to the bucket; zeros return."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, bucket: "ReplicatedGradBucket") -> torch.Tensor:
        ctx.bucket, ctx.param = bucket, param
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.bucket.add(ctx.param, grad)
        return torch.zeros_like(grad), None


class ReplicatedGradBucket:
    """The step's stashed contributions of TP-replicated parameters, summed over TP in one call."""

    def __init__(self, group, is_boundary: Callable[[], bool] = lambda: True):
        self.group = group
        self.is_boundary = is_boundary  # the engine's: is this backward the step's last?
        self.params: list[torch.nn.Parameter] = []  # first-use order: the same on every TP rank
        self._index: dict[int, int] = {}
        self._flat: Optional[torch.Tensor] = None
        self._flush_queued = False

    @run_eagerly
    def collect(self, param: torch.nn.Parameter) -> torch.Tensor:
        """`param` for a forward pass, its gradient routed through this bucket."""
        if id(param) not in self._index:
            self._index[id(param)] = len(self.params)
            self.params.append(param)
            self._flat = None  # resized on the next add
        return _Stash.apply(param, self)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self._flat is None:
            self._flat = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=like.device)
            self._offsets = [0]
            for p in self.params:
                self._offsets.append(self._offsets[-1] + p.numel())
        return self._flat

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Accumulate one use's contribution; at the boundary, have the sum run when backward ends."""
        flat = self._buffer(grad)
        i = self._index[id(param)]
        flat[self._offsets[i]:self._offsets[i + 1]].add_(grad.reshape(-1).to(torch.float32))
        if not self._flush_queued and self.is_boundary():
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        """All-reduce the step's contributions over TP (one call) and add them to the parameters' .grad."""
        self._flush_queued = False
        if self._flat is None:
            return
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(self._flat, group=self.group)
        for i, param in enumerate(self.params):
            summed = self._flat[self._offsets[i]:self._offsets[i + 1]].view_as(param).to(param.dtype)
            if param.grad is None:
                param.grad = summed.clone()
            else:
                param.grad.add_(summed)
        self._flat.zero_()
