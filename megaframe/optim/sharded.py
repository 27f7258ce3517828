"""Muon over matrices split across data-parallel ranks: each matrix has one owner rank, which alone
assembles it, orthogonalises it and sends every rank its part of the result back, as Megatron's
layer-wise distributed optimizer does.

A rank's part of a matrix is one contiguous range of its flattened elements (possibly empty), the
ranks' ranges in rank order: FSDP2's row shards (a DTensor's Shard(0): whole rows) and DeepSpeed
ZeRO's flat partitions (any cut, backends/deepspeed/muon_zero.py) alike. Per step, two
all_to_all_single over the shard group for all such matrices together: each rank sends its range of
every matrix to that matrix's owner, then each owner returns every rank its range of the results.
So Newton-Schulz work per rank is about 1/dp of the model's (owners balanced by its cost, the same
choice on every rank: a function of the shapes), and no rank holds more than its parts plus the
matrices it owns. Momentum, weight decay and the update stay elementwise on each rank's part."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

Range = tuple[int, int]  # [start, stop) of a matrix's flattened elements


def row_shard(p: torch.Tensor) -> Optional[tuple]:
    """(group, ranks, rank) where p is a DTensor split by rows (Shard(0)) over exactly one mesh dim of
    more than one rank and replicated over any other (HSDP's replicas), else None."""
    if not isinstance(p, DTensor):
        return None
    split = [d for d, placement in enumerate(p.placements) if not placement.is_replicate()]
    if len(split) != 1 or p.placements[split[0]] != Shard(0) or p.device_mesh.size(split[0]) == 1:
        return None
    dim = split[0]
    return p.device_mesh.get_group(dim), p.device_mesh.size(dim), p.device_mesh.get_local_rank(dim)


def row_counts(rows: int, ranks: int) -> list[int]:
    """Each rank's rows of a Shard(0) split (torch.chunk's: ceil(rows/ranks) each, the last ones
    shorter or empty)."""
    size = -(-rows // ranks)
    return [max(0, min(rows, (r + 1) * size) - r * size) for r in range(ranks)]


def row_ranges(shape: Sequence[int], ranks: int) -> list[Range]:
    """Each rank's flat range of a matrix split by rows (row_counts)."""
    width, start, out = math.prod(shape[1:]), 0, []
    for count in row_counts(shape[0], ranks):
        out.append((start, start + count * width))
        start += count * width
    return out


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz's work on a matrix, up to a constant: rows * cols * min(rows, cols) per iteration
    (a stack of matrices, experts x rows x cols: that of each, times the experts)."""
    rows, cols = shape[-2], shape[-1]
    return math.prod(shape[:-2]) * rows * cols * min(rows, cols)


def assign_owners(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """The owner of each matrix: the costliest first, each onto the least-loaded rank (ties: the lower
    index), so every rank computes the same assignment."""
    load, owners = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += ns_cost(shapes[i])
    return owners


class ShardedMatrices:
    """Matrices split over the ranks of one group by flat ranges, their owners, and the two
    exchanges of a step. ranges[i][r]: rank r's range of matrix i (contiguous, in rank order,
    together the whole matrix)."""

    def __init__(self, shapes: Sequence[Sequence[int]], ranges: Sequence[Sequence[Range]], group, ranks: int,
                 rank: int):
        self.shapes = [tuple(s) for s in shapes]
        for shape, parts in zip(self.shapes, ranges):
            if len(parts) != ranks or [b for _, b in parts[:-1]] != [a for a, _ in parts[1:]] \
                    or parts[0][0] != 0 or parts[-1][1] != math.prod(shape):
                raise ValueError(f"a {shape} matrix's ranges {list(parts)} do not cover it in rank order")
        self.counts = [[b - a for a, b in parts] for parts in ranges]
        self.group, self.ranks, self.rank = group, ranks, rank
        self.owners = assign_owners(self.shapes, ranks)
        self.received_numel = 0  # elements of whole matrices this rank assembled at the last step

    def owned(self) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == self.rank]

    def exchange(self, items: Sequence[tuple[int, torch.Tensor, Callable]]) -> list[torch.Tensor]:
        """items: (matrix index, this rank's part of its update (flat, its range's length), the
        matrix's orthogonalisation), the same matrices in the same order on every rank. Returns this
        rank's part of each result, flat fp32 (holding the bf16 values Newton-Schulz made: adding
        them is adding the bf16 result)."""
        ids = [i for i, _, _ in items]
        counts = self.counts
        by_owner = [[k for k, i in enumerate(ids) if self.owners[i] == r] for r in range(self.ranks)]
        mine = by_owner[self.rank]
        # to each owner, my part of every matrix it owns; from each rank, its part of the ones I own
        send_counts = [sum(counts[ids[k]][self.rank] for k in by_owner[r]) for r in range(self.ranks)]
        recv_counts = [sum(counts[ids[k]][s] for k in mine) for s in range(self.ranks)]
        device = items[0][1].device
        send = torch.cat([items[k][1].float().reshape(-1) for r in range(self.ranks) for k in by_owner[r]]) \
            if sum(send_counts) else torch.empty(0, device=device)
        received = self._exchange(send, recv_counts, send_counts)
        self.received_numel = received.numel()
        # assemble each owned matrix from every rank's part, orthogonalise it, cut it into parts again
        pieces = [list(chunk.split([counts[ids[k]][s] for k in mine])) for s, chunk in enumerate(received.split(recv_counts))]
        back, results = [], {}
        for n, k in enumerate(mine):
            i = ids[k]
            matrix = torch.cat([pieces[s][n] for s in range(self.ranks)]).view(self.shapes[i])
            results[k] = items[k][2](matrix).float().reshape(-1).split(counts[i])
        for s in range(self.ranks):
            back += [results[k][s] for k in mine]
        out = self._exchange(torch.cat(back) if back else torch.empty(0, device=device), send_counts, recv_counts)
        mine_back = {}
        for r, chunk in enumerate(out.split(send_counts)):
            for k, piece in zip(by_owner[r], chunk.split([counts[ids[k]][self.rank] for k in by_owner[r]])):
                mine_back[k] = piece
        return [mine_back[k] for k in range(len(items))]

    def _exchange(self, send: torch.Tensor, recv_counts: list[int], send_counts: list[int]) -> torch.Tensor:
        received = send.new_empty(sum(recv_counts))
        dist.all_to_all_single(received, send, recv_counts, send_counts, group=self.group)
        return received


class RowShardedMatrices(ShardedMatrices):
    """The row-sharded matrices (DTensor Shard(0), FSDP2's) of one shard group."""

    def __init__(self, params: Sequence[torch.Tensor]):
        shards = {row_shard(p) for p in params}
        if len(shards) != 1:
            raise ValueError(f"Muon assembles matrices within one shard group; these are split over {len(shards)}")
        (group, ranks, rank), = shards
        self.index = {id(p): i for i, p in enumerate(params)}
        super().__init__([p.shape for p in params], [row_ranges(p.shape, ranks) for p in params], group, ranks, rank)

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.index

    def orthogonalise(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, Callable]]) -> list[torch.Tensor]:
        """items: (param, this rank's rows of its update, the matrix's orthogonalisation), the same
        params in the same order on every rank. Returns this rank's rows of each result."""
        results = self.exchange([(self.index[id(p)], rows, fn) for p, rows, fn in items])
        return [result.view(rows.shape) for (_, rows, _), result in zip(items, results)]


@dataclass
class FlatPartition:
    """A rank's flat partition of many parameters (DeepSpeed ZeRO's fp32 partition of one group):
    the matrices with a part in it (matrices), and where each one's part lies in the partition
    (offsets[i]: its first element; its length is matrices.counts[i][rank])."""

    matrices: ShardedMatrices
    offsets: list[int]

    def parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's part of each matrix in `flat` (a tensor laid out as the partition), views."""
        rank = self.matrices.rank
        return [flat.narrow(0, at, counts[rank]) for at, counts in zip(self.offsets, self.matrices.counts)]
