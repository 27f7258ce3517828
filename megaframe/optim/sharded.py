"""Muon over matrices split across ranks (pieces.py says how: FSDP2's row shards over dp x cp or
HSDP's shard group, an expert stack's rows over its expert-data-parallel ranks, tensor parallelism's
column- and row-parallel pieces over tp, or tp x the shard group): each matrix has one owner rank
among the ranks holding its pieces, which alone assembles it, orthogonalises it and sends every rank
its piece of the result back, as Megatron's layer-wise distributed optimizer does.

Per step, per group and per bucket of its consecutive matrices, two all_to_all_single: each rank sends
its piece of every matrix to that matrix's owner, then each owner returns every rank its piece of the
results. The buckets and owners are a function of the full shapes, the same on every rank
(owners.bucket_owners): in each bucket no owner assembles more than optim.muon.exchange_bucket_size
elements of whole matrices (a larger matrix alone) and every rank of the group can own, so Newton-Schulz
work per rank is about 1/n of the group's, at least the largest matrix's. No rank holds more than its
pieces plus the matrices it owns, and the exchange's buffers hold one bucket's share at a time. Muon
exchanges in bf16 (wire_dtype): Newton-Schulz casts to bf16 first, and a result is bf16, so an fp32
wire would carry twice the bytes for the same values. Momentum, weight decay and the update stay
elementwise on each rank's piece. Where each rank's piece lies is exchanged once, when the optimizer is
built.

A piece is a range of the row-major elements of a box of the matrix (pieces.Piece): the whole box
(FSDP2, TP), a range of the whole matrix cut anywhere (DeepSpeed ZeRO's partitions), or a range of a
TP piece's box (ZeRO's partitions under tensor parallelism); the engine describes the last two
(backends/deepspeed/muon_zero.py), stepped through FlatPartition. Each owner cuts every rank's
range into at most 2 x ndim - 1 boxes (pieces.span_boxes) once, when it is built. exchange() works
on matrix indices and flat parts for all of them;
orthogonalise() keys it by parameter for the engines that step parameter tensors."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megaframe.optim.owners import bucket_owners
from megaframe.optim.pieces import Piece, PieceError, box, span_boxes


Part = tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]  # a piece: box offset, box shape, span


def _gather_parts(pieces: Sequence[Piece], group: Any, device: torch.device) -> torch.Tensor:
    """Every rank's part of each matrix, (ranks, matrices, 2 x ndim + 2): its box's offsets, then
    shapes (each padded to the group's largest ndim), then its span, from one all_gather when the
    optimizer is built."""
    ndim = max(len(p.full) for p in pieces)
    pad = lambda values: [*values, *(0,) * (ndim - len(values))]  # noqa: E731
    mine = torch.tensor([[*pad(p.offset), *pad(p.shape), *p.range()] for p in pieces], dtype=torch.int64,
                        device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).cpu()


def _unpack(row: list[int], full: tuple[int, ...]) -> Part:
    """A gathered row's part (offset, shape, span) of a `full` matrix."""
    ndim = (len(row) - 2) // 2
    return tuple(row[:len(full)]), tuple(row[ndim:ndim + len(full)]), (row[-2], row[-1])


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


def check_parts(full: tuple[int, ...], parts: Sequence[Part]) -> None:
    """The ranks' parts tile the matrix exactly: the distinct boxes of the non-empty parts tile it
    (check_tiling), and within each box the parts' spans cover [0, its elements) end to end, none
    twice (ZeRO's partitions of one TP piece over its data-parallel ranks)."""
    spans: dict[tuple, list[tuple[int, int]]] = {}
    for offset, shape, (start, stop) in parts:
        if stop > start:
            spans.setdefault((offset, shape), []).append((start, stop))
    check_tiling(full, list(spans))
    for (offset, shape), ranges in spans.items():
        ends = [0, *(e for pair in sorted(ranges) for e in pair), math.prod(shape)]
        if any(a != b for a, b in zip(ends[::2], ends[1::2])):
            raise PieceError(f"the ranks' spans {sorted(ranges)} of the box at {offset} of shape {shape} do not tile "
                             f"a {full} matrix")


class ShardedMatrices:
    """The split matrices of one group of ranks, their owners, and the two exchanges of a step.
    pieces: this rank's Piece of each matrix (the same matrices in the same order on every rank of
    the group, which all build it at once: one all_gather and one all_reduce); params: the parameter
    each one is, where the caller steps parameters (orthogonalise), else indices (exchange);
    bucket_elements: the most elements of whole matrices one owner assembles per exchange (0: one
    exchange); wire_dtype: the dtype pieces travel and matrices are assembled in (Muon: bf16, the
    dtype Newton-Schulz casts to first, so the results are the same bits)."""

    def __init__(self, pieces: Sequence[Piece], device: torch.device,
                 params: Optional[Sequence[torch.Tensor]] = None, bucket_elements: int = 0,
                 wire_dtype: torch.dtype = torch.float32):
        groups = {tuple(dist.get_process_group_ranks(p.group)) for p in pieces}
        if len(groups) != 1:
            raise PieceError(f"Muon assembles each set of matrices within one group; these span {len(groups)}")
        self.group = pieces[0].group
        self.ranks, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.index = {id(p): i for i, p in enumerate(params or ())}
        self.shapes = [p.full for p in pieces]
        self.wire_dtype = wire_dtype
        # exchanged a bucket at a time, each owner assembling at most bucket_elements in it (a larger
        # matrix alone): an exchange's buffers hold this rank's share of the bucket plus what it owns
        self.buckets, self.owners = bucket_owners(self.shapes, self.ranks, bucket_elements)
        self.bucket_of = [0] * len(self.shapes)
        for b, members in enumerate(self.buckets):
            for i in members:
                self.bucket_of[i] = b
        # kept: this rank's part of every matrix, and every rank's part of the matrices it owns (not
        # ranks x matrices parts on every rank); read to lists once, here, never in the step
        every = _gather_parts(pieces, self.group, device)
        self.mine = [_unpack(row, self.shapes[i]) for i, row in enumerate(every[self.rank].tolist())]
        self.theirs = {i: [_unpack(row, self.shapes[i]) for row in every[:, i].tolist()] for i in self.owned()}
        self._check(device)
        # each owned matrix's parts as boxes of it (pieces.span_boxes), computed once, not in the step
        self.regions = {i: [_regions(part) for part in parts] for i, parts in self.theirs.items()}
        self.received_numel = 0  # elements of whole matrices this rank assembled since new_step()
        self.largest_received = 0  # the most it received in one exchange since it was built

    def _check(self, device: torch.device) -> None:
        """Each owner checks that its matrices' pieces tile them; every rank of the group refuses
        together if one does not (a refusal on one rank alone would leave the others waiting)."""
        problem = None
        for i, boxes in self.theirs.items():
            try:
                check_parts(self.shapes[i], boxes)
            except PieceError as e:
                problem = problem or str(e)
        flag = torch.tensor([problem is not None], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            raise PieceError(problem or "another rank's matrix is not tiled by the ranks' pieces")

    def new_step(self) -> None:
        self.received_numel = 0

    def in_buckets(self, ids: Sequence[int]) -> list[list[int]]:
        """The positions in `ids` (matrix indices) grouped by the bucket each matrix is exchanged in,
        in bucket order: one exchange() per group, the same on every rank."""
        by_bucket: dict[int, list[int]] = {}
        for k, i in enumerate(ids):
            by_bucket.setdefault(self.bucket_of[i], []).append(k)
        return [by_bucket[b] for b in sorted(by_bucket)]

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.index

    def owned(self) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == self.rank]

    def _part(self, rank: int, i: int) -> Part:
        """Rank `rank`'s part of matrix i: this rank's own, or any rank's of a matrix this rank owns."""
        return self.mine[i] if rank == self.rank else self.theirs[i][rank]

    def _numel(self, rank: int, i: int) -> int:
        start, stop = self._part(rank, i)[2]
        return stop - start

    def local_numel(self, i: int) -> int:
        """The elements of matrix i this rank holds."""
        return self._numel(self.rank, i)

    def _cut(self, piece: torch.Tensor, i: int, rank: int) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
        """Rank `rank`'s piece of owned matrix i (its span's elements, flat) cut into its boxes' parts."""
        regions, sizes = self.regions[i][rank]
        return list(zip(regions, piece.split(sizes))) if sizes else []

    def orthogonalise(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, Callable]]) -> list[torch.Tensor]:
        """items: (param, this rank's piece of its update, the matrix's orthogonalisation), the same
        params in the same order on every rank of the group. Returns this rank's piece of each result,
        shaped like its update (exchange's)."""
        results = self.exchange([(self.index[id(p)], update, fn) for p, update, fn in items])
        return [result.view(update.shape) for (_, update, _), result in zip(items, results)]

    def exchange(self, items: Sequence[tuple[int, torch.Tensor, Callable]]) -> list[torch.Tensor]:
        """items: (matrix index, this rank's piece of its update (any shape, its piece's elements),
        the matrix's orthogonalisation), the same matrices in the same order on every rank of the
        group. Returns this rank's piece of each result, flat, in wire_dtype (fp32: holding the bf16
        values Newton-Schulz made; bf16: those values; an fp32 parameter adds either exactly alike),
        views of one received buffer. Each piece is cast to wire_dtype as it is sent, and the owner
        assembles and orthogonalises the matrix in it.

        Memory beyond the pieces: the send buffer until the first exchange returns; the received
        buffer, into which each owned matrix's result is cut back in place (its layout is the return
        send's), with one matrix and its result at a time; then the buffer the results come back in.
        A caller bounds them by exchanging one bucket at a time (in_buckets)."""
        if not items:  # the same on every rank of the group: none of them exchanges
            return []
        ids = [i for i, _, _ in items]
        by_owner: list[list[int]] = [[] for _ in range(self.ranks)]  # one pass: ranks x matrices would not scale
        for k, i in enumerate(ids):
            by_owner[self.owners[i]].append(k)
        mine = by_owner[self.rank]
        # to each owner, my piece of every matrix it owns; from each rank, its pieces of the ones I own
        send_counts = [sum(self._numel(self.rank, ids[k]) for k in by_owner[r]) for r in range(self.ranks)]
        recv_counts = [sum(self._numel(s, ids[k]) for k in mine) for s in range(self.ranks)]
        device = items[0][1].device
        send = torch.empty(sum(send_counts), dtype=self.wire_dtype, device=device)
        at = 0
        for k in (k for r in range(self.ranks) for k in by_owner[r]):
            n = self._numel(self.rank, ids[k])
            send.narrow(0, at, n).view(items[k][1].shape).copy_(items[k][1])
            at += n
        received = self._exchange(send, recv_counts, send_counts)
        del send
        self.received_numel += received.numel()
        self.largest_received = max(self.largest_received, received.numel())
        # assemble each owned matrix from every rank's piece, orthogonalise it, and cut the result into
        # the same places of `received` (rank s's pieces of the matrices I own, in order: the return's)
        pieces = [list(chunk.split([self._numel(s, ids[k]) for k in mine]))
                  for s, chunk in enumerate(received.split(recv_counts))]
        for n, k in enumerate(mine):
            i = ids[k]
            matrix = received.new_empty(self.shapes[i])
            for s in range(self.ranks):
                for where, part in self._cut(pieces[s][n], i, s):
                    matrix[where].copy_(part.view(matrix[where].shape))
            result = items[k][2](matrix)
            del matrix
            for s in range(self.ranks):
                for where, part in self._cut(pieces[s][n], i, s):
                    part.view(result[where].shape).copy_(result[where])
            del result
        del pieces
        out = self._exchange(received, send_counts, recv_counts)
        del received
        mine_back = {}
        for r, chunk in enumerate(out.split(send_counts)):
            for k, piece in zip(by_owner[r], chunk.split([self._numel(self.rank, ids[k]) for k in by_owner[r]])):
                mine_back[k] = piece
        return [mine_back[k] for k in range(len(items))]

    def _exchange(self, send: torch.Tensor, recv_counts: list[int], send_counts: list[int]) -> torch.Tensor:
        if self.ranks == 1:  # a group of one (each expert group at ep = dp): what it sends is what it receives
            return send
        received = send.new_empty(sum(recv_counts))
        dist.all_to_all_single(received, send, recv_counts, send_counts, group=self.group)
        return received


def _regions(part: Part) -> tuple[list[tuple[slice, ...]], list[int]]:
    """A part as the slices of the boxes of the matrix its span covers, in its elements' order, and
    each box's elements."""
    offset, shape, (start, stop) = part
    boxes = span_boxes(shape, start, stop)
    return ([box(tuple(o + a for o, a in zip(offset, at)), size) for at, size in boxes],
            [math.prod(size) for _, size in boxes])


@dataclass
class FlatPartition:
    """The matrices of one group of ranks with a part in a rank's flat partition of many parameters
    (DeepSpeed ZeRO's fp32 partition of one parameter group; a partition may hold matrices of several
    groups of ranks under tensor parallelism: one FlatPartition each), and where each one's part lies
    in the partition (offsets[i]: its first element; its length is matrices.local_numel(i))."""

    matrices: ShardedMatrices
    offsets: list[int]

    def parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's piece of each matrix in `flat` (a tensor laid out as the partition), views."""
        return [flat.narrow(0, at, self.matrices.local_numel(i)) for i, at in enumerate(self.offsets)]
