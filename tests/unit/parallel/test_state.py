"""ParallelState over ParallelDims, and the Megatron `mpu` adapter DeepSpeed reads."""
from __future__ import annotations

from megaframe.backends.deepspeed.topology import MegatronMpu, build_topology
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState


def test_coordinates_and_group_ranks():
    ps = ParallelState(ParallelDims(tp=2, dp=2), rank=3)
    assert (ps.tp_rank, ps.dp_rank, ps.pp_rank) == (1, 1, 0)
    assert ps.dp_ranks == [1, 3] and ps.group_ranks("tp") == [2, 3]
    assert ps.is_first_stage and ps.is_last_stage
    assert ps.group("tp") is None  # no process groups outside ParallelState.build


def test_mpu_interface():
    mpu = MegatronMpu(ParallelState(ParallelDims(tp=2, dp=2), rank=3))
    assert mpu.get_data_parallel_group_ranks() == [1, 3]
    assert mpu.get_tensor_model_parallel_src_rank() == 2
    assert mpu.get_model_parallel_world_size() == 2 and mpu.get_data_parallel_world_size() == 2
    assert mpu.get_data_parallel_rank() == 1 and mpu.get_pipeline_model_parallel_rank() == 0


def test_deepspeed_topology_has_the_same_rank_layout():
    """DeepSpeed's pipeline engine and ParallelDims must put every rank at the same (pp, dp, tp)."""
    dims = ParallelDims(pp=2, dp=2, tp=2)
    topology = build_topology(dims)
    for rank in range(dims.world_size):
        mine, theirs = dims.coords(rank), topology.get_coord(rank)
        assert (mine.pp, mine.dp, mine.tp) == (theirs.pipe, theirs.data, theirs.model), rank


def test_dropout_streams_differ_by_tp_and_cp_rank():
    """Attention dropout under cp draws from the rank's region stream: a cp rank must not repeat
    another's masks (nor a TP rank's), while cp rank 0 keeps the stream it had without cp."""
    import torch

    from megaframe.parallel.random import TPDropoutRNG

    def draw(rng: TPDropoutRNG) -> torch.Tensor:
        with rng.fork():
            return torch.rand(8)

    streams = {(tp, cp): draw(TPDropoutRNG(5, tp, cp)) for tp in range(2) for cp in range(3)}
    assert len({tuple(v.tolist()) for v in streams.values()}) == len(streams)
    assert torch.equal(streams[(1, 0)], draw(TPDropoutRNG(5, 1)))


def test_hsdp_groups_join_a_built_state_in_the_same_order_on_every_rank(monkeypatch):
    """ParallelState.build(grid with dp_replicate, reuse=state) on each of 8 simulated ranks: every rank
    creates the same groups in the same order (new_group is collective), only HSDP's new ones, and
    keeps the group objects it had."""
    import megaframe.parallel.state as state

    grid = ParallelDims(dp=4, tp=2)
    calls: dict[int, list[tuple[int, ...]]] = {}
    me = {"rank": 0}
    monkeypatch.setattr(state.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(state.dist, "get_world_size", lambda: grid.world_size)
    monkeypatch.setattr(state.dist, "get_rank", lambda: me["rank"])
    monkeypatch.setattr(state.dist, "new_group", lambda ranks: calls[me["rank"]].append(tuple(ranks)) or tuple(ranks))
    for rank in range(grid.world_size):
        me["rank"], calls[rank] = rank, []
        plain = ParallelState.build(grid)
        before = len(calls[rank])
        hsdp = ParallelState.build(ParallelDims(dp=4, tp=2, dp_replicate=2), reuse=plain)
        # dp x cp is [0, 2, 4, 6] or [1, 3, 5, 7]: shard groups of 2 neighbours, replicas 4 apart
        assert calls[rank][before:] == [(0, 2), (1, 3), (4, 6), (5, 7), (0, 4), (1, 5), (2, 6), (3, 7)]
        assert hsdp.group("dp_shard") == tuple(hsdp.group_ranks("dp_shard")) and rank in hsdp.group("dp_replicate")
        for axes in state.GROUP_AXES:
            assert hsdp.group(*axes) is plain.group(*axes)
    assert all(calls[rank] == calls[0] for rank in calls)
