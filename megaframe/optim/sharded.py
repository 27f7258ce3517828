"""Muon over matrices split across ranks (pieces.py says how: FSDP2's row shards over dp x cp or
HSDP's shard group, an expert stack's rows over its expert-data-parallel ranks, tensor parallelism's
column- and row-parallel pieces over tp, or tp x the shard group): each matrix has one owner rank
among the ranks holding its pieces, which alone assembles it, orthogonalises it and sends every rank
its piece of the result back, as Megatron's layer-wise distributed optimizer does.

Per step and per group, two all_to_all_single for all its matrices together: each rank sends its
piece of every matrix to that matrix's owner, then each owner returns every rank its piece of the
results. So Newton-Schulz work per rank is about 1/n of the group's (owners balanced by its cost,
the same choice on every rank: a function of the full shapes), and no rank holds more than its
pieces plus the matrices it owns. Momentum, weight decay and the update stay elementwise on each
rank's piece. Where each rank's piece lies is exchanged once, when the optimizer is built."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megaframe.optim.pieces import Piece, PieceError, box


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz's work on a matrix, up to a constant: rows * cols * min(rows, cols) per
    iteration; a stack of matrices (experts x rows x cols) costs that per matrix."""
    rows, cols = shape[-2:]
    return math.prod(shape[:-2]) * rows * cols * min(rows, cols)


def assign_owners(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """The owner of each matrix: the costliest first, each onto the least-loaded rank (ties: the lower
    index), so every rank computes the same assignment."""
    load, owners = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += ns_cost(shapes[i])
    return owners


def _gather_boxes(pieces: Sequence[Piece], group: Any, device: torch.device) -> torch.Tensor:
    """Every rank's box of each matrix, (ranks, matrices, 2 x ndim): offsets, then shapes (each
    padded to the group's largest ndim), from one all_gather when the optimizer is built."""
    ndim = max(len(p.full) for p in pieces)
    pad = lambda values: [*values, *(0,) * (ndim - len(values))]  # noqa: E731
    mine = torch.tensor([[*pad(p.offset), *pad(p.shape)] for p in pieces], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).cpu()


def _unpack(row: list[int], full: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ndim = len(row) // 2
    return tuple(row[:len(full)]), tuple(row[ndim:ndim + len(full)])


def check_tiling(full: tuple[int, ...], boxes: Sequence[tuple]) -> None:
    """The ranks' boxes tile the matrix exactly, as the grid its splits make: along each dim the
    distinct intervals cover [0, size) end to end, and every cell of their grid is one rank's box
    (else an update would be wrong: refused when the optimizer is built). O(ranks log ranks)."""
    cells = {tuple(zip(offset, shape)) for offset, shape in boxes if math.prod(shape)}
    held = sum(1 for _, shape in boxes if math.prod(shape))
    cuts = [sorted({cell[d] for cell in cells}) for d in range(len(full))]
    tiles = all(a[0] + a[1] == b[0] for dim in cuts for a, b in zip(dim, dim[1:])) and \
        all(dim and dim[0][0] == 0 and dim[-1][0] + dim[-1][1] == size for dim, size in zip(cuts, full))
    if not tiles or held != len(cells) or len(cells) != math.prod(len(dim) for dim in cuts):
        raise PieceError(f"the ranks' pieces {list(boxes)} do not tile a {full} matrix")


class ShardedMatrices:
    """The split matrices of one group of ranks, their owners, and the two exchanges of a step."""

    def __init__(self, params: Sequence[torch.Tensor], pieces: Sequence[Piece], device: torch.device):
        groups = {tuple(dist.get_process_group_ranks(p.group)) for p in pieces}
        if len(groups) != 1:
            raise PieceError(f"Muon assembles each set of matrices within one group; these span {len(groups)}")
        self.group = pieces[0].group
        self.ranks, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.index = {id(p): i for i, p in enumerate(params)}
        self.shapes = [p.full for p in pieces]
        self.owners = assign_owners(self.shapes, self.ranks)
        # kept: this rank's box of every matrix, and every rank's box of the matrices it owns (not
        # ranks x matrices boxes on every rank); read to lists once, here, never in the step
        every = _gather_boxes(pieces, self.group, device)
        self.mine = [_unpack(row, self.shapes[i]) for i, row in enumerate(every[self.rank].tolist())]
        self.theirs = {i: [_unpack(row, self.shapes[i]) for row in every[:, i].tolist()] for i in self.owned()}
        self._check(device)
        self.received_numel = 0  # elements of whole matrices this rank assembled at the last step

    def _check(self, device: torch.device) -> None:
        """Each owner checks that its matrices' pieces tile them; every rank of the group refuses
        together if one does not (a refusal on one rank alone would leave the others waiting)."""
        problem = None
        for i, boxes in self.theirs.items():
            try:
                check_tiling(self.shapes[i], boxes)
            except PieceError as e:
                problem = problem or str(e)
        flag = torch.tensor([problem is not None], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            raise PieceError(problem or "another rank's matrix is not tiled by the ranks' pieces")

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.index

    def owned(self) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == self.rank]

    def _box(self, rank: int, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Rank `rank`'s box of matrix i: this rank's own, or any rank's of a matrix this rank owns."""
        return self.mine[i] if rank == self.rank else self.theirs[i][rank]

    def _numel(self, rank: int, i: int) -> int:
        return math.prod(self._box(rank, i)[1])

    def orthogonalise(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, Callable]]) -> list[torch.Tensor]:
        """items: (param, this rank's piece of its update, the matrix's orthogonalisation), the same
        params in the same order on every rank of the group. Returns this rank's piece of each result
        (fp32 holding the bf16 values Newton-Schulz made: adding them is adding the bf16 result)."""
        ids = [self.index[id(p)] for p, _, _ in items]
        by_owner: list[list[int]] = [[] for _ in range(self.ranks)]  # one pass: ranks x matrices would not scale
        for k, i in enumerate(ids):
            by_owner[self.owners[i]].append(k)
        mine = by_owner[self.rank]
        # to each owner, my piece of every matrix it owns; from each rank, its pieces of the ones I own
        send_counts = [sum(self._numel(self.rank, ids[k]) for k in by_owner[r]) for r in range(self.ranks)]
        recv_counts = [sum(self._numel(s, ids[k]) for k in mine) for s in range(self.ranks)]
        device = items[0][1].device
        send = torch.cat([items[k][1].float().reshape(-1) for r in range(self.ranks) for k in by_owner[r]]) \
            if sum(send_counts) else torch.empty(0, device=device)
        received = self._exchange(send, recv_counts, send_counts)
        self.received_numel = received.numel()
        # assemble each owned matrix from every rank's piece, orthogonalise it, cut it into pieces again
        pieces = [list(chunk.split([self._numel(s, ids[k]) for k in mine]))
                  for s, chunk in enumerate(received.split(recv_counts))]
        back: list[list[torch.Tensor]] = [[] for _ in range(self.ranks)]
        for n, k in enumerate(mine):
            i = ids[k]
            matrix = received.new_empty(self.shapes[i])
            for s in range(self.ranks):
                offset, shape = self._box(s, i)
                if math.prod(shape):
                    matrix[box(offset, shape)] = pieces[s][n].view(shape)
            result = items[k][2](matrix).float()
            for s in range(self.ranks):
                offset, shape = self._box(s, i)
                back[s].append(result[box(offset, shape)].reshape(-1))
        flat = [piece for s in range(self.ranks) for piece in back[s]]
        out = self._exchange(torch.cat(flat) if flat else torch.empty(0, device=device), send_counts, recv_counts)
        mine_back = {}
        for r, chunk in enumerate(out.split(send_counts)):
            for k, piece in zip(by_owner[r], chunk.split([self._numel(self.rank, ids[k]) for k in by_owner[r]])):
                mine_back[k] = piece.view(items[k][1].shape)
        return [mine_back[k] for k in range(len(items))]

    def _exchange(self, send: torch.Tensor, recv_counts: list[int], send_counts: list[int]) -> torch.Tensor:
        received = send.new_empty(sum(recv_counts))
        dist.all_to_all_single(received, send, recv_counts, send_counts, group=self.group)
        return received
