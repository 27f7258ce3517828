"""The rank grid: tp fastest, then dp, then pp (DeepSpeed's PipeModelDataParallelTopology)."""
from __future__ import annotations

from megaframe.parallel.state import ParallelState, RankCoords, rank_coords


def test_rank_coords_order():
    assert [rank_coords(2, 2, 2, r) for r in (0, 1, 2, 5, 7)] == [
        RankCoords(0, 0, 0), RankCoords(0, 0, 1), RankCoords(0, 1, 0), RankCoords(1, 0, 1), RankCoords(1, 1, 1)]


def test_group_ranks_and_mpu_interface():
    ps = ParallelState(tp=2, pp=1, dp=2, rank=3)
    assert (ps.tp_rank, ps.dp_rank, ps.pp_rank) == (1, 1, 0)
    assert ps.get_data_parallel_group_ranks() == [1, 3]
    assert ps.get_tensor_model_parallel_src_rank() == 2
    assert ps.get_model_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 2
    assert ps.is_first_stage and ps.is_last_stage
