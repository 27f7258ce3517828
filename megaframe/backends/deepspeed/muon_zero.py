"""Muon as DeepSpeed ZeRO's client optimizer: where each hidden matrix lies in each rank's flat fp32
partition, handed to megaframe's Muon (optim/muon.py's partition_flat) so that every matrix is
assembled on one owner rank only (optim/sharded.py), not gathered on every partition.

ZeRO-1/2 (DeepSpeedZeroOptimizer, at fp32 and bf16 alike) flattens each parameter group into one
buffer, parameters one after another (each at round_robin_bit16_offsets, past alignment padding),
and gives rank r its elements [r * partition_size, (r + 1) * partition_size): a matrix's part on a
rank is the overlap, possibly empty. ZeRO-3 partitions each parameter on its own (rank r holds its
elements [r * n, (r + 1) * n), n = partition_numel()) and concatenates a sub-group's partitions into
one flat fp32 tensor. Either way DeepSpeed hands the client optimizer, in place of a group's
parameters, that rank's flat fp32 tensor with its reduced, unscaled and clipped gradient.

Under tensor parallelism each rank's parameters are its TP pieces (a row block of a column-parallel
matrix, a column block of a row-parallel one), which ZeRO flattens and cuts over the dp ranks: a
rank's part of such a matrix is a range of its TP box's row-major elements (a Piece with a span),
assembled over tp x dp; a matrix whole on every tp rank is assembled over dp alone."""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist

from megaframe.optim.muon import EXCHANGE_DTYPE, Muon
from megaframe.optim.pieces import Piece, tp_offset, tp_split
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
                   device: torch.device = torch.device("cpu"), bucket_elements: int = 0) -> FlatPartition:
    """The FlatPartition of whole matrices `shapes` split as `ranges` (per matrix, per rank: this rank's
    becomes its Piece's span; the others' are gathered and checked to tile each matrix when the
    ShardedMatrices is built, collectively over `group`, on `device`), whose parts on this rank start
    at `local` in its flat tensor (an empty part: 0), exchanged in buckets of at most bucket_elements
    per owner (0: one), in Muon's EXCHANGE_DTYPE."""
    boxes = [Box(tuple(shape), (0,) * len(shape), tuple(shape), group) for shape in shapes]
    return flat_partitions(boxes, ranges, local, rank, device, bucket_elements)[0]


class Box(NamedTuple):
    """A matrix's box a flat buffer holds (a TP piece, or the whole matrix) and the group of ranks
    holding its other elements (the dp ranks, or tp x dp)."""

    full: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    group: Any


def flat_partitions(boxes: list[Box], ranges: list[list[Range]], local: list[int], rank: int,
                    device: torch.device, bucket_elements: int) -> list[FlatPartition]:
    """One FlatPartition per group of ranks of the matrices whose boxes a flat buffer holds, each box
    split over that buffer's partitions as `ranges` (per box, per rank of the buffer's group: a range
    of the box's row-major elements), this rank's parts starting at `local` in its flat tensor. The
    groups in the order the boxes first name them (optim/muon.py's split_groups rule: the same on
    every rank, as every rank's buffer holds the same parameters in the same order)."""
    by_group: dict[tuple[int, ...], list[int]] = {}
    for i, b in enumerate(boxes):
        by_group.setdefault(tuple(dist.get_process_group_ranks(b.group)), []).append(i)
    out = []
    for members in by_group.values():
        pieces = [Piece(boxes[i].full, boxes[i].offset, boxes[i].shape, boxes[i].group, span=ranges[i][rank])
                  for i in members]
        offsets = [local[i] if ranges[i][rank][1] > ranges[i][rank][0] else 0 for i in members]
        matrices = ShardedMatrices(pieces, device, bucket_elements=bucket_elements, wire_dtype=EXCHANGE_DTYPE)
        out.append(FlatPartition(matrices, offsets))
    return out


def _box(p: torch.Tensor, shape: tuple[int, ...], dp_group, muon: Muon) -> Box:
    """The box of its matrix a parameter of local shape `shape` is (its TP piece, or the whole
    matrix), and the group of ranks holding the rest: tp x the ZeRO group, or the ZeRO group."""
    if not tp_split(p):
        return Box(tuple(shape), (0,) * len(shape), tuple(shape), dp_group)
    if muon.around_tp is None:
        raise ValueError("optim=muon: a tensor-parallel matrix in a ZeRO partition, and Muon was built without the "
                         "parallel state")
    full, offset = tp_offset(p, (0,) * len(shape))
    return Box(full, offset, tuple(shape), muon.around_tp.around(dp_group))


def _stage_1_2(zero, muon: Muon, muon_groups: set[int]) -> Iterator[tuple[torch.Tensor, list[FlatPartition]]]:
    """(flat fp32 partition, its matrices) of each Muon group of DeepSpeedZeroOptimizer."""
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        if i not in muon_groups:
            continue
        group = zero.real_dp_process_group[i]
        ranks, rank, size = dist.get_world_size(group), dist.get_rank(group), int(zero.partition_size[i])
        params, offsets = zero.round_robin_bit16_groups[i], zero.round_robin_bit16_offsets[i]
        boxes = [_box(p, tuple(p.shape), group, muon) for p in params]
        ranges = [[flat_part(o, p.numel(), r, size) for r in range(ranks)] for o, p in zip(offsets, params)]
        local = [o + parts[rank][0] - rank * size for o, parts in zip(offsets, ranges)]
        yield flat, flat_partitions(boxes, ranges, local, rank, flat.device, muon.exchange_bucket_size)


def _stage_3(zero, muon: Muon, muon_groups: set[int]) -> Iterator[tuple[torch.Tensor, list[FlatPartition]]]:
    """(flat fp32 partition, its matrices) of each sub-group of a Muon group of ZeRO-3's optimizer."""
    for sub, params in enumerate(zero.fp16_groups):
        if zero.sub_group_to_group_id[sub] not in muon_groups:
            continue
        group = zero.sub_group_process_groups[sub]
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        boxes, ranges, local, at = [], [], [], 0
        for p in params:
            n = p.partition_numel()
            boxes.append(_box(p, tuple(p.ds_shape), group, muon))
            ranges.append([(min(r * n, p.ds_numel), min((r + 1) * n, p.ds_numel)) for r in range(ranks)])
            local.append(at)
            at += n
        flat = zero.fp32_partitioned_groups_flat[sub]
        yield flat, flat_partitions(boxes, ranges, local, rank, flat.device, muon.exchange_bucket_size)


def describe_partitions(zero, muon: Muon) -> None:
    """Tell `muon` (the client optimizer `zero` wraps) where its matrices lie in each flat partition
    of a Muon group. Refuses a ZeRO optimizer whose layout it does not know (never a wrong update)."""
    muon_groups = {i for i, group in enumerate(muon.param_groups) if group_optimizer(group) == "muon"}
    if hasattr(zero, "fp32_partitioned_groups_flat") and not getattr(zero, "offload_optimizer", False):
        partitions = _stage_3(zero, muon, muon_groups)
    elif hasattr(zero, "single_partition_of_fp32_groups") and not getattr(zero, "cpu_offload", False):
        partitions = _stage_1_2(zero, muon, muon_groups)
    else:
        raise ValueError(f"optim=muon: DeepSpeed's {type(zero).__name__} steps partitions megaframe's Muon cannot "
                         f"locate matrices in; use zero=stage1, stage2 or stage3 without offload")
    for flat, parts in partitions:
        muon.partition_flat(flat, parts)
