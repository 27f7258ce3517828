"""Boxes: rectangular pieces of a tensor, described by (offset, shape) per dimension.

A rank's share of a parameter is a contiguous flat range of its tensor-parallel shard (ZeRO
partitions the flattened shard), which is not a rectangle of the full tensor. flat_range_boxes cuts
such a range into a few rectangles (a partial first row, whole rows, a partial last row),
so every stored chunk and every read request is a box of the full tensor and resharding is box
intersection, whatever the layouts on either side. Pure Python: the planner and tests use it too.
"""
from __future__ import annotations

from math import prod
from typing import NamedTuple, Optional


class Box(NamedTuple):
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def shifted(self, by: tuple[int, ...]) -> "Box":
        return Box(tuple(o + b for o, b in zip(self.offset, by)), self.shape)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes covering elements [start, stop) of a row-major tensor of `shape`, in order: a
    partial first row (itself cut the same way one dimension down), whole rows, a partial last
    row. At most 2*ndim - 1 boxes (3 for a matrix; stacked experts are 3-D)."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    inner = prod(shape[1:])
    first_row, first_offset = divmod(start, inner)
    last_row, last_offset = divmod(stop, inner)  # stop is exclusive: last_offset elements of last_row

    def within(row: int, a: int, b: int) -> list[Box]:
        return [Box((row, *box.offset), (1, *box.shape)) for box in flat_range_boxes(shape[1:], a, b)]
    if first_row == last_row:
        return within(first_row, first_offset, last_offset)
    boxes = []
    if first_offset:
        boxes += within(first_row, first_offset, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(Box((first_row, *[0] * (len(shape) - 1)), (last_row - first_row, *shape[1:])))
    if last_offset:
        boxes += within(last_row, 0, last_offset)
    return boxes


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes of the same tensor, or None."""
    offset, shape = [], []
    for ao, asz, bo, bsz in zip(a.offset, a.shape, b.offset, b.shape):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return Box(tuple(offset), tuple(shape))


def clip_rows(box: Box, rows: int) -> Optional[Box]:
    """The part of `box` in rows [0, rows) (the unpadded vocabulary), or None."""
    stop = min(box.offset[0] + box.shape[0], rows)
    if stop <= box.offset[0]:
        return None
    return Box(box.offset, (stop - box.offset[0], *box.shape[1:]))


def even_range(numel: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `count` near-equal contiguous parts of `numel` elements
    (ZeRO-3's partition rule: ceil-sized parts, the last one short)."""
    size = -(-numel // count)
    return min(index * size, numel), min((index + 1) * size, numel)
