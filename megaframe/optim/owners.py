"""Which rank owns (assembles and orthogonalises) each of a group's whole matrices, bucket by bucket:
a function of the full shapes only, so every rank of the group computes the same, and the planner
computes it too (plan/optimizer.py) without building anything. No torch here: the planner imports it.

Why per bucket: optim/sharded.py exchanges a bucket of consecutive matrices at a time and each
exchange waits for every owner of that bucket, so a step's Newton-Schulz time is the sum over buckets
of the busiest owner's work in each, not the busiest rank's total. optim.muon.exchange_bucket_size
bounds what one rank assembles per exchange, not what a bucket holds: a bucket takes matrices, in
order, while some rank has room for the next (or owns nothing in it yet), so every rank of the group
works in every bucket. Bounding the bucket's total instead put one matrix in each bucket wherever a
matrix is larger than the bound (gpt_1t's at tp8 x dp6: rank 0 owned every one, 47 ranks idle)."""
from __future__ import annotations

import heapq
import math
from typing import Sequence


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz's work on a matrix, up to a constant: rows * cols * min(rows, cols) per
    iteration; a stack of matrices (experts x rows x cols) costs that per matrix."""
    rows, cols = shape[-2:]
    return math.prod(shape[:-2]) * rows * cols * min(rows, cols)


def buckets(shapes: Sequence[Sequence[int]], bucket_elements: int, ranks: int = 1) -> list[list[int]]:
    """The matrices' indices in the consecutive runs bucket_owners exchanges them in (0: every matrix in
    one run). At one rank, runs of at most bucket_elements elements of whole matrices, a larger one alone."""
    return bucket_owners(shapes, ranks, bucket_elements)[0]


def assign_owners(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """The owner of each matrix: the costliest first, each onto the least-loaded rank (ties: the lower
    rank), so every rank computes the same assignment. A heap of (load, rank): the planner assigns
    thousands of matrices over thousands of ranks per layout it tries. Only the lowest len(shapes) ranks
    can be chosen (each idle one, lowest first, before any loaded one), so the heap holds only those."""
    load = [(0, rank) for rank in range(min(ranks, len(shapes)))]  # sorted: already a heap
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        held, rank = heapq.heappop(load)
        owners[i] = rank
        heapq.heappush(load, (held + ns_cost(shapes[i]), rank))
    return owners


class _Bucket:
    """The owners of the bucket being filled. A rank can take a matrix if what it assembles here stays
    within the bound, or if it owns nothing here yet; of those, the least Newton-Schulz cost here, then
    the least carried over the earlier buckets, then the lower rank. The ranks never chosen yet stay
    out of the heaps (idle ones are taken lowest first, so those are len(carried) and above): the work
    per matrix grows with the ranks that own something, not with the group's ranks."""

    def __init__(self, limit: int, ranks: int, carried: list[int]):
        self.limit, self.ranks, self.carried = limit, ranks, carried  # carried[r]: rank r's cost so far
        self.idle = [(cost, rank) for rank, cost in enumerate(carried)]  # used ranks not yet owners here
        heapq.heapify(self.idle)
        self.owning: list[tuple[int, int, int]] = []  # (cost here, carried, rank) of this bucket's owners
        self.held: dict[int, int] = {}  # rank -> elements it assembles in this bucket
        self.cost: dict[int, int] = {}  # rank -> its Newton-Schulz cost in this bucket

    def _first_idle(self) -> tuple[int, int] | None:
        """(carried, rank) of the idle rank to choose: a used one from the heap or the lowest fresh one."""
        first = [self.idle[0]] if self.idle else []
        if len(self.carried) < self.ranks:
            first.append((0, len(self.carried)))
        return min(first, default=None)

    def take(self, numel: int, cost: int) -> int | None:
        """The rank that owns the next matrix (numel elements, Newton-Schulz cost `cost`), or None where
        no rank can take it (the bucket is full)."""
        idle = self._first_idle()
        skipped, rank = [], None
        while self.owning and (idle is None or self.owning[0] < (0, *idle)):
            key = heapq.heappop(self.owning)
            if self.held[key[2]] + numel <= self.limit:
                rank = key[2]
                break
            skipped.append(key)  # no room for this one; maybe for a smaller one later
        for key in skipped:
            heapq.heappush(self.owning, key)
        if rank is None:
            if idle is None:
                return None
            rank = idle[1]
            if rank == len(self.carried):
                self.carried.append(0)
            else:
                heapq.heappop(self.idle)
        self.held[rank] = self.held.get(rank, 0) + numel
        self.cost[rank] = self.cost.get(rank, 0) + cost
        heapq.heappush(self.owning, (self.cost[rank], self.carried[rank], rank))
        return rank

    def close(self) -> None:
        """Carry each owner's cost in this bucket over to the next buckets' ties."""
        for rank, cost in self.cost.items():
            self.carried[rank] += cost

    def balance(self, shapes: Sequence[Sequence[int]], members: list[int], owners: list[int]) -> None:
        """The bucket's matrices (filled in order, which took its members and its owner ranks) shared
        out again among the same ranks costliest first, each onto the one with the least cost here (then
        the least carried, then the lower rank) that has room: assign_owners' balance (in one bucket of
        ranks never used before, its very assignment), within the bound. Where that packing finds no
        room for a matrix, the in-order owners stay. Updates owners and this bucket's costs."""
        load = [(0, self.carried[rank], rank) for rank in self.cost]
        heapq.heapify(load)
        held = dict.fromkeys(self.cost, 0)
        chosen: dict[int, int] = {}
        for i in sorted(members, key=lambda i: (-ns_cost(shapes[i]), i)):
            numel, skipped = math.prod(shapes[i]), []
            while load and held[load[0][2]] and held[load[0][2]] + numel > self.limit:
                skipped.append(heapq.heappop(load))  # no room on this one for this matrix
            if not load:
                return
            here, carried, rank = heapq.heappop(load)
            for key in skipped:
                heapq.heappush(load, key)
            chosen[i], held[rank] = rank, held[rank] + numel
            heapq.heappush(load, (here + ns_cost(shapes[i]), carried, rank))
        self.cost = dict.fromkeys(self.cost, 0)
        for i, rank in chosen.items():
            owners[i] = rank
            self.cost[rank] += ns_cost(shapes[i])


def bucket_owners(shapes: Sequence[Sequence[int]], ranks: int,
                  bucket_elements: int) -> tuple[list[list[int]], list[int]]:
    """The buckets (consecutive runs of the matrices' indices, each exchanged on its own) and each
    matrix's owner. bucket_elements: the most elements of whole matrices one rank assembles in one
    exchange (a larger matrix alone on its owner); a bucket takes the next matrix while some rank can
    (_Bucket.take), then its matrices are shared out costliest first within it (_Bucket.balance). 0:
    every matrix in one bucket, balanced costliest first (assign_owners)."""
    if not bucket_elements:
        return ([list(range(len(shapes)))] if shapes else []), assign_owners(shapes, ranks)
    runs: list[list[int]] = []
    owners = [0] * len(shapes)
    carried: list[int] = []
    bucket = None
    for i, shape in enumerate(shapes):
        numel, cost = math.prod(shape), ns_cost(shape)
        rank = bucket.take(numel, cost) if bucket else None
        if rank is None:  # a new bucket: every rank idle in it, so some rank takes the matrix
            if bucket:
                bucket.balance(shapes, runs[-1], owners)
                bucket.close()
            bucket = _Bucket(bucket_elements, ranks, carried)
            runs.append([])
            rank = bucket.take(numel, cost)
        runs[-1].append(i)
        owners[i] = rank
    if bucket:
        bucket.balance(shapes, runs[-1], owners)
    return runs, owners
