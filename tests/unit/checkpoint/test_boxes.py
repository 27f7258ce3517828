"""Boxes against brute force: the boxes of a flat range hold exactly that range's elements, in order."""
from __future__ import annotations

import itertools

import pytest
import torch

from megaframe.checkpoint.boxes import Box, clip_rows, even_range, flat_range_boxes, intersect


def _take(full: torch.Tensor, box: Box) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape))]


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 6), (1, 9), (9, 1), (2, 3, 4), (3, 1, 2), (2, 2, 1, 3)])
def test_flat_range_boxes_cover_exactly_the_range(shape):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    n = full.numel()
    for start, stop in itertools.combinations(range(n + 1), 2):
        boxes = flat_range_boxes(shape, start, stop)
        got = torch.cat([_take(full, b).flatten() for b in boxes])
        assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
    assert flat_range_boxes(shape, 4, 4) == []


def test_intersect_matches_masks():
    shape = (6, 5)
    boxes = [Box((r, c), (h, w)) for r in range(6) for c in range(5) for h in (1, 2, 4) for w in (1, 3)
             if r + h <= 6 and c + w <= 5]
    for a, b in itertools.product(boxes[::7], boxes[::5]):
        mask_a, mask_b = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
        _take(mask_a, a).fill_(True)
        _take(mask_b, b).fill_(True)
        common = intersect(a, b)
        expected = mask_a & mask_b
        if common is None:
            assert not expected.any()
        else:
            got = torch.zeros(shape, dtype=torch.bool)
            _take(got, common).fill_(True)
            assert torch.equal(got, expected)


def test_clip_rows_and_even_range():
    assert clip_rows(Box((3, 0), (4, 2)), 5) == Box((3, 0), (2, 2))
    assert clip_rows(Box((5, 0), (4, 2)), 5) is None
    parts = [even_range(10, i, 4) for i in range(4)]
    assert parts == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [even_range(2, i, 4) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
