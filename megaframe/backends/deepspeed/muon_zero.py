"""Muon as DeepSpeed ZeRO's client optimizer: where each hidden matrix lies in each rank's flat fp32
partition, handed to megaframe's Muon (optim/muon.py's partition_flat) so that every matrix is
assembled on one owner rank only (optim/sharded.py), not gathered on every partition.

ZeRO-1/2 (DeepSpeedZeroOptimizer, at fp32 and bf16 alike) flattens each parameter group into one
buffer, parameters one after another (each at round_robin_bit16_offsets, past alignment padding),
and gives rank r its elements [r * partition_size, (r + 1) * partition_size): a matrix's part on a
rank is the overlap, possibly empty. ZeRO-3 partitions each parameter on its own (rank r holds its
elements [r * n, (r + 1) * n), n = partition_numel()) and concatenates a sub-group's partitions into
one flat fp32 tensor. Either way DeepSpeed hands the client optimizer, in place of a group's
parameters, that rank's flat fp32 tensor with its reduced, unscaled and clipped gradient."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megaframe.optim.muon import Muon
from megaframe.optim.pieces import Piece
from megaframe.optim.sharded import FlatPartition, ShardedMatrices
from megaframe.optim.table import group_optimizer

Range = tuple[int, int]  # [start, stop) of a matrix's flattened elements


def flat_part(offset: int, numel: int, rank: int, partition: int) -> Range:
    """The range [start, stop) of a parameter (numel elements from `offset` of a flat buffer) that
    rank's partition [rank * partition, (rank + 1) * partition) holds; empty at its nearer end."""
    def clip(at: int) -> int:
        return min(max(at - offset, 0), numel)
    return clip(rank * partition), clip((rank + 1) * partition)


def flat_partition(shapes: list[tuple[int, ...]], ranges: list[list[Range]], local: list[int], group, rank: int,
                   device: torch.device = torch.device("cpu")) -> FlatPartition:
    """The FlatPartition of matrices `shapes` split as `ranges` (per matrix, per rank: this rank's
    becomes its flat Piece; the others' are gathered and checked to tile each matrix when the
    ShardedMatrices is built, collectively over `group`, on `device`), whose parts on this rank start
    at `local` in its flat tensor (an empty part: 0)."""
    pieces = [Piece(tuple(shape), (parts[rank][0],), (parts[rank][1] - parts[rank][0],), group, flat=True)
              for shape, parts in zip(shapes, ranges)]
    offsets = [at if parts[rank][1] > parts[rank][0] else 0 for at, parts in zip(local, ranges)]
    return FlatPartition(ShardedMatrices(pieces, device), offsets)


def _stage_1_2(zero, muon_groups: set[int]) -> Iterator[tuple[torch.Tensor, FlatPartition]]:
    """(flat fp32 partition, its matrices) of each Muon group of DeepSpeedZeroOptimizer."""
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        if i not in muon_groups:
            continue
        group = zero.real_dp_process_group[i]
        ranks, rank, size = dist.get_world_size(group), dist.get_rank(group), int(zero.partition_size[i])
        metas, offsets = zero.round_robin_bit16_meta[i], zero.round_robin_bit16_offsets[i]
        shapes = [tuple(m.shape) for m in metas]
        ranges = [[flat_part(o, m.numel(), r, size) for r in range(ranks)] for o, m in zip(offsets, metas)]
        local = [o + parts[rank][0] - rank * size for o, parts in zip(offsets, ranges)]
        yield flat, flat_partition(shapes, ranges, local, group, rank, flat.device)


def _stage_3(zero, muon_groups: set[int]) -> Iterator[tuple[torch.Tensor, FlatPartition]]:
    """(flat fp32 partition, its matrices) of each sub-group of a Muon group of ZeRO-3's optimizer."""
    for sub, params in enumerate(zero.fp16_groups):
        if zero.sub_group_to_group_id[sub] not in muon_groups:
            continue
        group = zero.sub_group_process_groups[sub]
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        shapes, ranges, local, at = [], [], [], 0
        for p in params:
            n = p.partition_numel()
            shapes.append(tuple(p.ds_shape))
            ranges.append([(min(r * n, p.ds_numel), min((r + 1) * n, p.ds_numel)) for r in range(ranks)])
            local.append(at)
            at += n
        flat = zero.fp32_partitioned_groups_flat[sub]
        yield flat, flat_partition(shapes, ranges, local, group, rank, flat.device)


def describe_partitions(zero, muon: Muon) -> None:
    """Tell `muon` (the client optimizer `zero` wraps) where its matrices lie in each flat partition
    of a Muon group. Refuses a ZeRO optimizer whose layout it does not know (never a wrong update)."""
    muon_groups = {i for i, group in enumerate(muon.param_groups) if group_optimizer(group) == "muon"}
    if hasattr(zero, "fp32_partitioned_groups_flat") and not getattr(zero, "offload_optimizer", False):
        partitions = _stage_3(zero, muon_groups)
    elif hasattr(zero, "single_partition_of_fp32_groups") and not getattr(zero, "cpu_offload", False):
        partitions = _stage_1_2(zero, muon_groups)
    else:
        raise ValueError(f"optim=muon: DeepSpeed's {type(zero).__name__} steps partitions megaframe's Muon cannot "
                         f"locate matrices in; use zero=stage1, stage2 or stage3 without offload")
    for flat, partition in partitions:
        muon.partition_flat(flat, partition)
