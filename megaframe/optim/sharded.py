"""Muon over matrices FSDP2 splits by rows across data-parallel ranks (a DTensor's Shard(0) over one
mesh dim): each matrix has one owner rank, which alone assembles it, orthogonalises it and sends
every rank its rows of the result back, as Megatron's layer-wise distributed optimizer does.

Per step, two all_to_all_single over the shard group for all such matrices together: each rank sends
its rows of every matrix to that matrix's owner, then each owner returns every rank its rows of the
results. So Newton-Schulz work per rank is about 1/dp of the model's (owners balanced by its cost,
the same choice on every rank: a function of the shapes), and no rank holds more than its shards plus
the matrices it owns. Momentum, weight decay and the update stay elementwise on each rank's rows."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


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


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz's work on a matrix, up to a constant: rows * cols * min(rows, cols) per iteration."""
    rows, cols = shape[0], math.prod(shape[1:])
    return rows * cols * min(rows, cols)


def assign_owners(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """The owner of each matrix: the costliest first, each onto the least-loaded rank (ties: the lower
    index), so every rank computes the same assignment."""
    load, owners = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += ns_cost(shapes[i])
    return owners


class RowShardedMatrices:
    """The row-sharded matrices of one shard group, their owners, and the two exchanges of a step."""

    def __init__(self, params: Sequence[torch.Tensor]):
        shards = {row_shard(p) for p in params}
        if len(shards) != 1:
            raise ValueError(f"Muon assembles matrices within one shard group; these are split over {len(shards)}")
        (self.group, self.ranks, self.rank), = shards
        self.index = {id(p): i for i, p in enumerate(params)}
        self.shapes = [tuple(p.shape) for p in params]
        self.owners = assign_owners(self.shapes, self.ranks)
        self.received_numel = 0  # elements of whole matrices this rank assembled at the last step

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.index

    def owned(self) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == self.rank]

    def orthogonalise(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, Callable]]) -> list[torch.Tensor]:
        """items: (param, this rank's rows of its update, the matrix's orthogonalisation), the same
        params in the same order on every rank. Returns this rank's rows of each result (fp32 holding
        the bf16 values Newton-Schulz made: adding them is adding the bf16 result)."""
        ids = [self.index[id(p)] for p, _, _ in items]
        rows = {i: row_counts(self.shapes[i][0], self.ranks) for i in ids}
        width = {i: math.prod(self.shapes[i][1:]) for i in ids}
        by_owner = [[k for k, i in enumerate(ids) if self.owners[i] == r] for r in range(self.ranks)]
        mine = by_owner[self.rank]
        # to each owner, my rows of every matrix it owns; from each rank, its rows of the ones I own
        send_counts = [sum(rows[ids[k]][self.rank] * width[ids[k]] for k in by_owner[r]) for r in range(self.ranks)]
        recv_counts = [sum(rows[ids[k]][s] * width[ids[k]] for k in mine) for s in range(self.ranks)]
        device = items[0][1].device
        send = torch.cat([items[k][1].float().reshape(-1) for r in range(self.ranks) for k in by_owner[r]]) \
            if sum(send_counts) else torch.empty(0, device=device)
        received = self._exchange(send, recv_counts, send_counts)
        self.received_numel = received.numel()
        # assemble each owned matrix from every rank's rows, orthogonalise it, cut it into rows again
        pieces = [list(chunk.split([rows[ids[k]][s] * width[ids[k]] for k in mine]))
                  for s, chunk in enumerate(received.split(recv_counts))]
        back, results = [], {}
        for n, k in enumerate(mine):
            i = ids[k]
            matrix = torch.cat([pieces[s][n] for s in range(self.ranks)]).view(self.shapes[i])
            results[k] = items[k][2](matrix).float().reshape(-1).split([r * width[i] for r in rows[i]])
        for s in range(self.ranks):
            back += [results[k][s] for k in mine]
        out = self._exchange(torch.cat(back) if back else torch.empty(0, device=device), send_counts, recv_counts)
        mine_back = {}
        for r, chunk in enumerate(out.split(send_counts)):
            for k, piece in zip(by_owner[r], chunk.split([rows[ids[k]][self.rank] * width[ids[k]] for k in by_owner[r]])):
                mine_back[k] = piece.view(items[k][1].shape)
        return [mine_back[k] for k in range(len(items))]

    def _exchange(self, send: torch.Tensor, recv_counts: list[int], send_counts: list[int]) -> torch.Tensor:
        received = send.new_empty(sum(recv_counts))
        dist.all_to_all_single(received, send, recv_counts, send_counts, group=self.group)
        return received
