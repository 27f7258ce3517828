"""Where this rank's piece of a Muon matrix lies in the whole matrix, and which ranks hold the other
pieces (the group sharded.py assembles it over).

A parameter reaches the optimizer in one of these forms (DESIGN: no rank gathers what it does not own):
- whole: a plain tensor, or a DTensor whose only splits are over mesh dims of one rank (a mesh of
  one, HSDP's replicas over a shard group of one);
- split by FSDP2 over one mesh dim (Shard(0) of a dense matrix over dp x cp or HSDP's dp_shard
  ranks, Shard(1) of an expert stack over its expert-data-parallel ranks): the group is that dim's;
- split by tensor parallelism (parallel/layers.py's marks: column-parallel by output rows,
  row-parallel by input columns), and within that piece by FSDP2 over the dense shard group: the
  group is tp x that shard group, a group ParallelState does not create, made here (tp_groups).
An expert stack split by experts over ep ranks is whole per expert: its local experts are what is
assembled, never the other ranks' experts. DeepSpeed ZeRO's flat partitions cut any of these into
ranges of their row-major elements (a Piece's span; backends/deepspeed/muon_zero.py describes them),
which span_boxes turns back into boxes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Piece:
    """This rank's part of the matrix `full`: the range `span` [start, stop) of the row-major elements
    of a box of it (offset and shape per dim; span None: the whole box), and the group holding the
    other parts (None: the part is the whole matrix). A box alone is FSDP2's or TP's piece; a span of
    the whole matrix is a DeepSpeed ZeRO partition's (cut anywhere, even mid-row); a span of a TP
    piece's box is ZeRO's partition of a TP piece (backends/deepspeed/muon_zero.py)."""

    full: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    group: Any = None
    span: Optional[tuple[int, int]] = None

    def range(self) -> tuple[int, int]:
        """The span, [0, the box's elements) where it is the whole box."""
        return self.span if self.span is not None else (0, math.prod(self.shape))


class PieceError(ValueError):
    """A parameter split in a way Muon cannot assemble (never stepped with a wrong update)."""


def split_mesh_dim(p: torch.Tensor) -> Optional[int]:
    """The one mesh dim of more than one rank a DTensor is split over (None: whole on this rank)."""
    if not isinstance(p, DTensor):
        return None
    split = [d for d, placement in enumerate(p.placements)
             if not placement.is_replicate() and p.device_mesh.size(d) > 1]
    if len(split) > 1 or (split and not isinstance(p.placements[split[0]], Shard)):
        raise PieceError(f"sharded as {p.placements} over a mesh of {p.device_mesh.size()} ranks")
    return split[0] if split else None


def tp_split(p: torch.Tensor) -> bool:
    """Split by tensor parallelism (an expert stack split by experts is not: its experts are whole)."""
    shard = getattr(p, "shard", None)
    if getattr(p, "partition_count", 1) <= 1:
        return False
    if shard is None or shard.axis not in ("tp", "ep"):
        raise PieceError(f"split {p.partition_count} ways along an axis Muon does not assemble")
    return shard.axis == "tp"


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the matrix (or expert stack) Newton-Schulz acts on: a TP piece's whole matrix,
    else the parameter's own (global) shape. Its last two dims set the learning-rate adjustment."""
    return tuple(p.partition_shape) if tp_split(p) else tuple(p.shape)


def tp_offset(p: torch.Tensor, offset: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The full matrix of a TP-split `p` and where in it lies the box at `offset` of p's TP piece."""
    full, along, offset = tuple(p.partition_shape), p.partition_dim, list(offset)
    offset[along] += p.partition_index * (full[along] // p.partition_count)
    return full, tuple(offset)


def piece(p: torch.Tensor, around_tp: Optional["TPGroups"] = None) -> Piece:
    """Where this rank's part of `p` lies in its full matrix, and the group of the other parts."""
    dim = split_mesh_dim(p)
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    else:
        shape, offset = tuple(p.shape), (0,) * p.ndim
    offset = list(offset)
    if dim is not None and p.ndim == 3 and p.placements[dim].dim == 0:
        dim = None  # a stack split by its experts: each rank holds whole matrices, nothing to assemble
    shard_group = None if dim is None else p.device_mesh.get_group(dim)
    if not tp_split(p):
        return Piece(tuple(p.shape), tuple(offset), tuple(shape), shard_group)
    if around_tp is None:
        raise PieceError(f"split {p.partition_count} ways by tensor parallelism, and Muon was built without "
                         f"the parallel state to assemble it")
    full, at = tp_offset(p, tuple(offset))
    return Piece(full, at, tuple(shape), around_tp.around(shard_group))


class TPGroups:
    """The groups a TP-split matrix is assembled over: the tp ranks, times the dense shard group
    where FSDP2 shards the TP piece too (dp x cp, or HSDP's dp_shard). Made on every rank at once
    (dist.new_group is collective over the world): build the optimizer on every rank."""

    def __init__(self, ps):
        self.tp = ps.group("tp")
        dense = ("dp_shard",) if ps.grid.dp_replicate > 1 else ("dp", "cp")
        self.dense_ranks = tuple(ps.group_ranks(*dense))
        self.both = self.tp
        if ps.grid.size(*dense) > 1:
            axes = (*dense, "tp")
            for ranks in ps.grid.groups(*axes):  # every rank creates every group, in the same order
                group = dist.new_group(ranks=ranks)
                if ps.rank in ranks:
                    self.both = group

    def around(self, shard_group) -> Any:
        """The group of a TP piece FSDP2 shards over shard_group (None: not sharded)."""
        if shard_group is None:
            return self.tp
        if tuple(dist.get_process_group_ranks(shard_group)) != self.dense_ranks:
            raise PieceError("a TP-split matrix is sharded over ranks other than its dense shard group")
        return self.both


def tp_groups(ps) -> Optional[TPGroups]:
    """TPGroups of this rank under tensor parallelism (None without, or without process groups)."""
    if ps is None or ps.grid.tp == 1 or not dist.is_initialized():
        return None
    return TPGroups(ps)


def box(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The slices of a box (offset, shape)."""
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def box_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


def span_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The range [start, stop) of a `shape` box's row-major elements as boxes within it, in order (their
    elements one after another are the range's): at most 2 * ndim - 1 (a partial first row, whole
    rows, a partial last row, each partial row the same again one dim down). Empty: none."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    row, rest = math.prod(shape[1:]), shape[1:]
    first_whole, end_whole = -(-start // row), stop // row  # the whole rows: [first_whole, end_whole)

    def within(r: int, a: int, b: int) -> list[Box]:  # [a, b) of row r's elements
        return [((r, *o), (1, *s)) for o, s in span_boxes(rest, a, b)]
    if first_whole > end_whole:  # inside one row
        r = start // row
        return within(r, start - r * row, stop - r * row)
    boxes = within(start // row, start % row, row) if start % row else []
    if end_whole > first_whole:
        boxes.append(((first_whole, *(0,) * len(rest)), (end_whole - first_whole, *rest)))
    if stop % row:
        boxes += within(end_whole, 0, stop % row)
    return boxes
