"""Which rank owns (assembles and orthogonalises) each of a group's whole matrices, bucket by bucket:
a function of the full shapes only, so every rank of the group computes the same, and the planner
computes it too (plan/optimizer.py) without building anything. No torch here: the planner imports it.

Why per bucket: optim/sharded.py exchanges a bucket of consecutive matrices at a time and each
exchange waits for every owner of that bucket, so a step's Newton-Schulz time is the sum over buckets
of the busiest rank's work in each, not the busiest rank's total. A bucket that holds fewer matrices
than the group has ranks leaves ranks idle: at llama2_7b dp=8, buckets of 5·10⁷ elements (one to
three matrices each) make the busiest rank run 6.5 times its balanced share."""
from __future__ import annotations

import heapq
import math
from typing import Sequence


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz's work on a matrix, up to a constant: rows * cols * min(rows, cols) per
    iteration; a stack of matrices (experts x rows x cols) costs that per matrix."""
    rows, cols = shape[-2:]
    return math.prod(shape[:-2]) * rows * cols * min(rows, cols)


def buckets(shapes: Sequence[Sequence[int]], bucket_elements: int) -> list[list[int]]:
    """The matrices' indices in consecutive runs of at most bucket_elements elements of whole
    matrices (a larger matrix alone), each run exchanged on its own; 0: every matrix in one run."""
    if not bucket_elements:
        return [list(range(len(shapes)))] if shapes else []
    runs: list[list[int]] = []
    size = 0
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        if runs and size + n <= bucket_elements:
            runs[-1].append(i)
            size += n
        else:
            runs.append([i])
            size = n
    return runs


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


def bucket_owners(shapes: Sequence[Sequence[int]], ranks: int, bucket_elements: int) -> tuple[list[list[int]], list[int]]:
    """The buckets (buckets()) and each matrix's owner, balanced within its bucket."""
    runs = buckets(shapes, bucket_elements)
    owners = [0] * len(shapes)
    for members in runs:
        for i, owner in zip(members, assign_owners([shapes[i] for i in members], ranks)):
            owners[i] = owner
    return runs, owners
