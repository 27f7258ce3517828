"""Megatron-style tensor-parallel layers. Each holds its shard of the full weight, described by a
ShardSpec (`param.shard`: which ParallelDims axis, which tensor dimension) plus the attributes
DeepSpeed and Megatron tooling read: tensor_model_parallel, partition_dim, partition_shape (full),
partition_count, partition_index."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megaframe.parallel.matmul import DEFAULT as DEFAULT_MATMUL
from megaframe.parallel.matmul import MatmulRecipe, MatmulSite
from megaframe.parallel.mappings import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                         reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 for the steps that must not run in bf16 (norms, RoPE, the router, the loss); an fp64
    tensor stays fp64, so a float64 model (the parity tests' exact reference) keeps its precision."""
    return x if x.dtype == torch.float64 else x.float()


@dataclass(frozen=True)
class TPGroup:
    """What a layer needs to know about tensor parallelism: the group, its size, this rank, SP."""

    group: Any = None  # torch.distributed process group; None for a single rank
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False
    grad_bucket: Any = None  # a ReplicatedGradBucket: sum replicated gradients once per step, not per use
    matmul: MatmulRecipe = DEFAULT_MATMUL  # how the layers' weight matmuls compute (parallel/matmul.py)

    def site(self, kind: str) -> MatmulSite:
        """The seam a layer of `kind` (matmul.KINDS) calls for its local GEMM, fixed at build."""
        return MatmulSite(kind, self)

    def for_layer(self, layer) -> "TPGroup":
        """This group with the recipe of `layer` (MatmulRecipe.for_layer): itself unless a precision
        recipe keeps that layer in the model's dtype (fp8's bf16_layers)."""
        recipe = self.matmul.for_layer(layer)
        return self if recipe is self.matmul else replace(self, matmul=recipe)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a TP region: replicated input (backward all-reduce), or all-gathered sequence under SP."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.group)
        return copy_to_tp_region(x, self.group)

    def exit(self, partial: torch.Tensor) -> torch.Tensor:
        """Out of a TP region: sum partial outputs (all-reduce, or reduce-scatter the sequence under SP)."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tp_region(partial, self.group)

    def sync_grad(self, param: torch.Tensor, on_shards: Optional[bool] = None) -> torch.Tensor:
        """A replicated parameter used on per-rank data: identity forward, gradient summed over TP
        (once per step through grad_bucket when there is one, else at this use).

        on_shards defaults to "under sequence parallelism" (norm gains, row-parallel biases).
        """
        if on_shards is None:
            on_shards = self.sequence_parallel
        if not on_shards or self.size == 1:
            return param
        if self.grad_bucket is not None:
            return self.grad_bucket.collect(param)
        return copy_to_tp_region(param, self.group)


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split: along tensor dimension `dim`, over the ranks of parallel axis
    `axis` (a ParallelDims axis: "tp" today, "ep" for experts), in equal contiguous pieces."""

    axis: str
    dim: int

    def bounds(self, full_shape: tuple[int, ...], index: int, count: int) -> tuple[int, int]:
        """[start, stop) of piece `index` of `count` along `dim` (a reader can fetch just that)."""
        size = full_shape[self.dim] // count
        return index * size, (index + 1) * size

    def take(self, full: torch.Tensor, index: int, count: int) -> torch.Tensor:
        """Piece `index` of `count` of the full tensor (what rank `index` of the axis holds)."""
        start, stop = self.bounds(tuple(full.shape), index, count)
        return full.narrow(self.dim, start, stop - start)

    def gather(self, piece: torch.Tensor, group, count: int) -> torch.Tensor:
        """The full tensor from every rank's piece (a collective over `group`, `count` ranks)."""
        if count == 1:
            return piece
        pieces = [torch.empty_like(piece) for _ in range(count)]
        dist.all_gather(pieces, piece.contiguous(), group=group)
        return torch.cat(pieces, dim=self.dim)


def mark_shard(param: nn.Parameter, full_shape: tuple[int, ...], dim: int, tp: TPGroup) -> nn.Parameter:
    """Record that `param` is slice tp.rank of tp.size along `dim` of a tensor of full_shape."""
    param.shard = ShardSpec("tp", dim)
    param.tensor_model_parallel = tp.size > 1
    param.partition_dim = dim
    param.partition_shape = tuple(full_shape)
    param.partition_count = tp.size
    param.partition_index = tp.rank
    return param


def _divide(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} does not split over tp={tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A split by output rows: each rank computes its slice of the outputs.

    enter=False when the caller already entered the TP region once for several layers (q, k, v
    share one entry so the backward all-reduce happens once, as with Megatron's fused QKV).
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = True,
                 enter: bool = True, kind: str = "column"):
        super().__init__()
        self.tp, self.enter = tp, enter
        self.matmul = tp.site(kind)  # "head" for the vocabulary-parallel LM head
        local = _divide(out_features, tp, "output features")
        self.weight = mark_shard(nn.Parameter(torch.empty(local, in_features)), (out_features, in_features), 0, tp)
        self.bias = mark_shard(nn.Parameter(torch.empty(local)), (out_features,), 0, tp) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter:
            x = self.tp.enter(x)
        return self.matmul.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A split by input columns: the input arrives split, partial outputs are summed."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = True):
        super().__init__()
        self.tp = tp
        self.matmul = tp.site("row")
        local = _divide(in_features, tp, "input features")
        self.weight = mark_shard(nn.Parameter(torch.empty(out_features, local)), (out_features, in_features), 1, tp)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # replicated, added once after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.exit(self.matmul.linear(x, self.weight))
        if self.bias is not None:
            y = y + self.tp.sync_grad(self.bias)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the padded vocabulary) are split across TP ranks; outputs are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.rows_per_rank = _divide(num_embeddings, tp, "padded vocabulary")
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = mark_shard(nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim)),
                                 (num_embeddings, embedding_dim), 0, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp.group)
