"""Every stored tensor's chunks tile it exactly: each inside the tensor, no two overlapping, no gap.

A reader fills what no chunk covers with zeros (that is how it pads a layout's vocabulary rows,
which lie beyond the stored, unpadded shape). Without this check an index that lost a chunk
(a rank's record dropped, an edited or damaged index) loaded as zeros in resume, eval and export.
The check is a sweep along the first dimension: between consecutive chunk edges the chunks in
play must tile the remaining dimensions, checked the same way one dimension down, once per
distinct set of chunks (a ZeRO partition's chunks are a few rows each, so the cost is about
linear in the number of chunks, not in the tensor's size).
"""
from __future__ import annotations

from collections import defaultdict
from math import prod
from typing import Any, Optional

Extent = tuple[int, ...]
Rect = tuple[Extent, Extent]  # (offset, shape)


def whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chunk_entry_problem(chunk: Any, shape: Extent) -> Optional[str]:
    """What is wrong with one index entry of a tensor of `shape` (its types, or its box leaving
    the tensor), or None."""
    if not isinstance(chunk, dict) or not isinstance(chunk.get("file"), str) or not isinstance(chunk.get("key"), str):
        return "a chunk entry is not {file, key, offset, shape}"
    offset, size = chunk.get("offset"), chunk.get("shape")
    if not (isinstance(offset, list) and isinstance(size, list) and len(offset) == len(size) == len(shape)
            and all(whole_number(v) and v >= 0 for v in offset + size)):
        return f"chunk {chunk['key'][:80]!r} has offset/shape that are not {len(shape)} whole numbers >= 0"
    if any(o + s > n for o, s, n in zip(offset, size, shape)):
        return (f"chunk {chunk['key'][:80]!r} (offset {offset}, shape {size}) reaches beyond the tensor's "
                f"shape {list(shape)}")
    return None


def _tiling_problem(rects: list[Rect], extent: Extent) -> Optional[tuple[str, Extent]]:
    """('gap' | 'overlap', where) when rects do not tile `extent` exactly, else None. Every rect
    lies inside extent and holds at least one element."""
    if not extent:
        return None if len(rects) == 1 else (("gap", ()) if not rects else ("overlap", ()))
    if len(extent) == 1:
        position = 0
        for start, length in sorted((o[0], s[0]) for o, s in rects):
            if start != position:
                return ("gap" if start > position else "overlap", (min(start, position),))
            position = start + length
        return None if position == extent[0] else ("gap", (position,))
    starting, ending = defaultdict(list), defaultdict(list)
    for index, (offset, size) in enumerate(rects):
        starting[offset[0]].append(index)
        ending[offset[0] + size[0]].append(index)
    edges = sorted({0, extent[0], *starting, *ending})
    active: set[int] = set()
    checked: dict[frozenset, Optional[tuple[str, Extent]]] = {}
    for low in edges[:-1]:  # the slab from this edge to the next
        active.difference_update(ending[low])
        active.update(starting[low])
        if not active:
            return "gap", (low, *[0] * (len(extent) - 1))
        slab = frozenset(active)
        if slab not in checked:
            checked[slab] = _tiling_problem([(rects[i][0][1:], rects[i][1][1:]) for i in slab], extent[1:])
        if checked[slab] is not None:
            kind, where = checked[slab]
            return kind, (low, *where)
    return None


def coverage_problem(shape: Extent, chunks: Any) -> Optional[str]:
    """Why `chunks` (index entries) do not tile a tensor of `shape` exactly, or None."""
    if not isinstance(chunks, list):
        return "its chunk list is not a list"
    for chunk in chunks:
        if problem := chunk_entry_problem(chunk, shape):
            return problem
    if prod(shape) == 0:
        return None
    rects = [(tuple(c["offset"]), tuple(c["shape"])) for c in chunks if prod(c["shape"])]
    found = _tiling_problem(rects, tuple(shape))
    if found is None:
        return None
    kind, where = found
    if kind == "gap":
        return f"no chunk covers element {list(where)} of its shape {list(shape)} (a chunk is missing)"
    return f"two chunks overlap at element {list(where)} of its shape {list(shape)}"
