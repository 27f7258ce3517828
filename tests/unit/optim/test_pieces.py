"""Where a rank's piece of a Muon matrix lies (optim/pieces.py) and the check that the ranks' pieces
tile each matrix exactly (optim/sharded.py), without ranks: a tensor-parallel piece's full shape
sets the learning rate; a split Muon cannot assemble, or pieces that overlap, leave a gap or stick
out, are refused when the optimizer is built (never a wrong update); a range of a box's elements
(ZeRO's partition of a TP piece) as boxes, and ranges that do not tile their box refused alike."""
from __future__ import annotations

import math

import pytest
import torch

from megaframe.optim.muon import Muon
from megaframe.optim.pieces import PieceError, box, full_shape, piece, span_boxes
from megaframe.optim.sharded import check_parts, check_tiling
from megaframe.parallel.layers import ShardSpec

# (5, 8) as tp=2 by columns x 2 uneven dp shards by rows; (2, 6) with an empty dp shard
TILINGS = [((5, 8), [((0, 0), (3, 4)), ((3, 0), (2, 4)), ((0, 4), (3, 4)), ((3, 4), (2, 4))]),
           ((2, 6), [((0, 0), (1, 6)), ((1, 0), (0, 6)), ((1, 0), (1, 6)), ((2, 0), (0, 6))]),
           ((3, 4, 5), [((0, 0, 0), (3, 2, 5)), ((0, 2, 0), (3, 2, 5))]),
           ((40,), [((0,), (13,)), ((13,), (27,)), ((40,), (0,))])]  # a flat (5, 8): cut mid-row, one empty
NOT_TILINGS = [((5, 8), [((0, 0), (3, 4)), ((3, 0), (2, 4)), ((0, 0), (3, 4)), ((3, 0), (2, 4))]),  # twice one half
               ((5, 8), [((0, 0), (3, 8)), ((2, 0), (3, 8))]),  # rows 2 twice, as many elements
               ((5, 8), [((0, 0), (5, 4)), ((0, 3), (5, 4))]),  # columns overlapping
               ((5, 8), [((0, 0), (3, 8))]),  # a gap
               ((5, 8), [((0, 0), (3, 8)), ((3, 0), (3, 8))]),  # past the last row
               ((40,), [((0,), (13,)), ((12,), (28,))]),  # flat ranges overlapping by one element
               ((40,), [((0,), (13,)), ((14,), (26,))])]  # flat ranges leaving element 13 out


@pytest.mark.parametrize("full, boxes", TILINGS)
def test_pieces_that_tile_the_matrix_pass(full, boxes):
    check_tiling(full, boxes)


@pytest.mark.parametrize("full, boxes", NOT_TILINGS)
def test_pieces_that_do_not_tile_it_are_refused(full, boxes):
    with pytest.raises(PieceError, match="do not tile"):
        check_tiling(full, boxes)


def _marked(shape, axis: str, dim: int, full) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape))
    p.shard, p.partition_dim, p.partition_shape = ShardSpec(axis, dim), dim, full
    p.partition_count, p.partition_index = 2, 1
    return p


def test_a_tp_piece_names_its_whole_matrix_and_needs_the_parallel_state():
    row_parallel = _marked((6, 4), "tp", 1, (6, 8))
    assert full_shape(row_parallel) == (6, 8)  # the learning rate adjusts by (6, 8), not (6, 4)
    with pytest.raises(PieceError, match="without the parallel state"):
        piece(row_parallel)
    experts = _marked((2, 6, 4), "ep", 0, (4, 6, 4))  # this rank's experts: whole matrices, nothing to assemble
    assert full_shape(experts) == (2, 6, 4) and piece(experts).group is None
    with pytest.raises(PieceError, match="axis Muon does not assemble"):
        piece(_marked((6, 4), "cp", 1, (6, 8)))
    with pytest.raises(ValueError, match=r"a \(6, 4\) parameter is split 2 ways by tensor parallelism"):
        Muon([{"params": [row_parallel], "optimizer": "muon"}], momentum=0.9, nesterov=True, ns_coefficients=(1, 1, 1),
             ns_steps=1, eps=1e-7, adjust_lr="spectral", betas=(0.9, 0.9), adamw_eps=1e-8)


@pytest.mark.parametrize("shape", [(5,), (4, 6), (1, 8), (6, 1), (3, 4, 5), (2, 3, 1, 4)])
def test_a_span_of_a_box_is_its_boxes_in_order(shape):
    """span_boxes against brute force: for every [start, stop), the boxes' elements one after another
    are exactly the row-major elements start..stop-1 of the box, in at most 2 x ndim - 1 boxes."""
    numbered = torch.arange(math.prod(shape)).view(shape)
    for start in range(numbered.numel() + 1):
        for stop in range(start, numbered.numel() + 1):
            boxes = span_boxes(shape, start, stop)
            got = [numbered[box(offset, size)].reshape(-1) for offset, size in boxes]
            assert torch.equal(torch.cat([torch.zeros(0, dtype=torch.int64), *got]), torch.arange(start, stop)), \
                (shape, start, stop, boxes)
            assert len(boxes) <= 2 * len(shape) - 1 and all(math.prod(size) for _, size in boxes)


# (full, parts: (offset, shape, span)): ZeRO's ranges of two row-parallel TP pieces (column blocks)
# over two dp ranks each, cut mid-row; the whole matrix in ranges; a rank holding nothing
ROW_PARALLEL = [((0, 0), (5, 4), (0, 7)), ((0, 0), (5, 4), (7, 20)),
                ((0, 4), (5, 4), (0, 13)), ((0, 4), (5, 4), (13, 20))]
PART_TILINGS = [((5, 8), ROW_PARALLEL),
                ((5, 8), [((0, 0), (5, 8), (0, 40)), ((0, 0), (5, 8), (40, 40))]),
                ((2, 3, 4), [((0, 0, 0), (2, 3, 4), (0, 5)), ((0, 0, 0), (2, 3, 4), (5, 24))]),
                ((5, 8), [((0, 0), (3, 8), (0, 24)), ((3, 0), (2, 8), (0, 16))])]  # boxes alone
PART_NOT_TILINGS = [((5, 8), ROW_PARALLEL[:3]),  # the last 7 elements of the second column block missing
                    ((5, 8), [*ROW_PARALLEL[:3], ((0, 4), (5, 4), (12, 20))]),  # element 12 twice
                    ((5, 8), [ROW_PARALLEL[0], ((0, 0), (5, 4), (8, 20)), *ROW_PARALLEL[2:]]),  # element 7 never
                    # the column blocks overlapping
                    ((5, 8), [*ROW_PARALLEL[:2], ((0, 3), (5, 4), (0, 13)), ((0, 3), (5, 4), (13, 20))]),
                    ((5, 8), [((0, 0), (5, 8), (0, 40)), ((0, 0), (5, 8), (0, 40))])]  # the whole matrix twice


@pytest.mark.parametrize("full, parts", PART_TILINGS)
def test_parts_whose_spans_tile_their_boxes_pass(full, parts):
    check_parts(full, parts)


@pytest.mark.parametrize("full, parts", PART_NOT_TILINGS)
def test_parts_that_leave_out_or_repeat_elements_are_refused(full, parts):
    with pytest.raises(PieceError, match="do not tile"):
        check_parts(full, parts)
