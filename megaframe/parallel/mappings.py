"""Collectives as autograd functions (Megatron's factoring), each taking its process group.

Activations are (B, T, C): the tensor-parallel split is along the last dim, the sequence-parallel
split along dim 1. With a group of one rank every function is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # on a copy: the tensor handed to us may be a caller's gradient or saved for another backward
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = _size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {size} ranks")
    return x.chunk(size, dim=dim)[_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Forward identity, backward all-reduce: enter a TP region whose ranks each see all of x."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward all-reduce, backward identity: sum the partial outputs of a row-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward keep this rank's slice of the last dim, backward all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward all-gather the last dim, backward keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """Forward keep this rank's sequence shard, backward all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, SEQ_DIM, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """Forward all-gather the sequence, backward reduce-scatter it (SP's entry to a TP region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Forward reduce-scatter the sequence, backward all-gather it (SP's exit from a TP region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, SEQ_DIM, ctx.group), None


def _apply(fn, x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _run_collective(fn, x, group)


@torch.compiler.disable
def _run_collective(fn, x: torch.Tensor, group) -> torch.Tensor:
    # Under train.compile the graph breaks here and the collective runs eagerly, on both passes.
    # Dynamo cannot trace every c10d call (the sequence-parallel gathers made it recompile every
    # step, 13x slower than eager); the compute between collectives still compiles. With a group
    # of one, _apply returns before this, so tp=1 blocks compile into one graph.
    return fn.apply(x, group)


def copy_to_tp_region(x, group):
    """Identity forward; all-reduce of the gradient backward."""
    return _apply(_CopyToRegion, x, group)


def reduce_from_tp_region(x, group):
    """All-reduce forward; identity backward."""
    return _apply(_ReduceFromRegion, x, group)


def scatter_to_tp_region(x, group):
    """Split the last dim forward; all-gather backward."""
    return _apply(_ScatterToRegion, x, group)


def gather_from_tp_region(x, group):
    """All-gather the last dim forward; split backward."""
    return _apply(_GatherFromRegion, x, group)


def scatter_to_sequence_parallel_region(x, group):
    """Split the sequence forward; all-gather backward."""
    return _apply(_ScatterToSequence, x, group)


def gather_from_sequence_parallel_region(x, group):
    """All-gather the sequence forward; reduce-scatter backward."""
    return _apply(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Reduce-scatter the sequence forward; all-gather backward."""
    return _apply(_ReduceScatterToSequence, x, group)
