"""Collectives as autograd functions (Megatron's factoring), each taking its process group.

Activations are (B, T, C): the tensor-parallel split is along the last dim, the sequence-parallel
split along dim 1. With a group of one rank every function is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaframe.common.compile_breaks import run_eagerly

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


# Single-tensor collectives: one flat buffer, one call (NCCL runs a list all_gather as a group of
# per-rank calls). torch 2.13 renamed them *_single; older torch only has the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = _size(group)
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)  # rank r's x lands in rows [r*B, (r+1)*B)
    if dim == 0:
        return out
    return torch.cat(out.chunk(size, dim=0), dim=dim)  # one copy into place, as Megatron's last-dim gather


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = _size(group)
    if dim != 0:  # rank r's share must be the r-th block of the flat input
        x = torch.cat(x.chunk(size, dim=dim), dim=0)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
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


@run_eagerly
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


# ---- tokens: (N, C) rows, for the Mixture-of-Experts layer ---------------------------------------

class _SplitTokens(torch.autograd.Function):
    """Forward keep this rank's 1/size of the rows, backward all-gather them (the rows' gradients
    come from the rank that routed them)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    """Forward all-gather the rows, backward keep this rank's rows (downstream of here every rank
    holds the same, whole gradient: a replicated region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, 0, ctx.group), None


class _AllToAllRows(torch.autograd.Function):
    """Rows to ranks: input_splits[j] rows go to rank j, output_splits[j] come from it; backward
    sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all_rows(x: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    rows = sum(output_splits) if output_splits is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def gather_values(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather x along dim over group, outside autograd: values no gradient flows to (token ids),
    one single-tensor collective on x's device."""
    return _gather(x, dim, group)


def sum_values(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of x over group's ranks, outside autograd (a count), on x's device; x is left as it was."""
    total = x.clone()
    dist.all_reduce(total, group=group)
    return total


def split_tokens(x, group):
    """Keep this rank's contiguous 1/size of the rows forward; all-gather the gradient backward."""
    return _apply(_SplitTokens, x, group)


def gather_tokens(x, group):
    """All-gather the rows forward; keep this rank's rows of the gradient backward."""
    return _apply(_GatherTokens, x, group)


def all_to_all_rows(x: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    """All-to-all of rows with per-rank counts (None: equal parts), differentiable."""
    return _all_to_all_rows_eagerly(x, output_splits, input_splits, group)  # looked up here: see compile_breaks


@run_eagerly
def _all_to_all_rows_eagerly(x: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    return _AllToAllRows.apply(x, output_splits, input_splits, group)


# ---- scales: not differentiated ------------------------------------------------------------------

@run_eagerly
def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """x, in place, the elementwise maximum over the group's ranks: the amax of an fp8 scale whose
    tensor spans the TP ranks (parallel/fp8/scaled.py). A collective on the device, no host sync;
    the identity for a group of one."""
    if _size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x
