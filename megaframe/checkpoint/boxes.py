"""Boxes: rectangular pieces of a tensor, described by (offset, shape) per dimension.

A rank's share of a parameter is a contiguous flat range of its tensor-parallel shard (ZeRO
partitions the flattened shard), which is not a rectangle of the full tensor. flat_range_boxes cuts
such a range into at most three rectangles (a partial first row, whole rows, a partial last row),
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
    """The boxes covering elements [start, stop) of a row-major tensor of `shape` (1-D or 2-D), in order."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    if len(shape) != 2:
        raise ValueError(f"flat ranges of {len(shape)}-D tensors are not supported (shape {shape})")
    cols = shape[1]
    first_row, first_col = divmod(start, cols)
    last_row, last_col = divmod(stop, cols)  # stop is exclusive: last_col elements of last_row
    if first_row == last_row:
        return [Box((first_row, first_col), (1, last_col - first_col))]
    boxes = []
    if first_col:
        boxes.append(Box((first_row, first_col), (1, cols - first_col)))
        first_row += 1
    if last_row > first_row:
        boxes.append(Box((first_row, 0), (last_row - first_row, cols)))
    if last_col:
        boxes.append(Box((last_row, 0), (1, last_col)))
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
