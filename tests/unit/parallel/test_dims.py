"""ParallelDims: coordinates and group members, checked against lists written out by hand."""
from __future__ import annotations

import pytest

from megaframe.parallel.dims import ParallelDims, RankCoords


def test_tp2_cp2_ep2_dp2_pp2_coordinates():
    dims = ParallelDims(pp=2, dp=2, cp=2, ep=2, tp=2)
    assert dims.world_size == 16 and dims.edp == 2
    # rank bits, lowest first: tp, cp, dp, pp; ep is the fast half of dp x cp (here cp), edp the slow (dp)
    assert dims.coords(0) == RankCoords(pp=0, dp=0, cp=0, tp=0, ep=0, edp=0)
    assert dims.coords(1) == RankCoords(pp=0, dp=0, cp=0, tp=1, ep=0, edp=0)
    assert dims.coords(2) == RankCoords(pp=0, dp=0, cp=1, tp=0, ep=1, edp=0)
    assert dims.coords(4) == RankCoords(pp=0, dp=1, cp=0, tp=0, ep=0, edp=1)
    assert dims.coords(8) == RankCoords(pp=1, dp=0, cp=0, tp=0, ep=0, edp=0)
    assert dims.coords(13) == RankCoords(pp=1, dp=1, cp=0, tp=1, ep=0, edp=1)
    assert dims.coords(14) == RankCoords(pp=1, dp=1, cp=1, tp=0, ep=1, edp=1)
    assert dims.rank(pp=1, dp=1, cp=1, tp=0) == 14
    assert [dims.rank(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp) for c in map(dims.coords, range(16))] == list(range(16))


def test_tp2_cp2_ep2_dp2_pp2_groups():
    dims = ParallelDims(pp=2, dp=2, cp=2, ep=2, tp=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert dims.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert dims.groups("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    # gradients of dense parameters are reduced over dp x cp
    assert dims.groups("dp", "cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    # here ep coincides with cp and edp with dp (ep = cp = 2 splits dp x cp exactly there)
    assert dims.groups("ep") == dims.groups("cp")
    assert dims.groups("edp") == dims.groups("dp")
    assert dims.groups("tp", "cp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert dims.group_of(13, "dp", "cp") == [9, 11, 13, 15]
    assert dims.size("dp", "cp") == 4 and dims.size() == 1


def test_expert_groups_split_data_parallel_ranks():
    """dp=4, ep=2, tp=2: experts sharded over neighbouring data-parallel ranks, replicated across the rest."""
    dims = ParallelDims(dp=4, ep=2, tp=2)
    assert dims.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.coords(6) == RankCoords(pp=0, dp=3, cp=0, tp=0, ep=1, edp=1)


def test_the_default_grid_is_one_rank():
    dims = ParallelDims()
    assert dims.world_size == 1 and dims.groups("dp") == [[0]] and dims.describe() == "tp=1 pp=1 dp=1"


def test_every_spelling_of_a_layout_names_the_same_axes():
    """The start-up line, W&B's run name and the run metadata spell one layout alike: cp and ep when
    used (the W&B name and the metadata once dropped ep)."""
    dims = ParallelDims(tp=2, dp=2, cp=2, ep=4)
    assert dims.describe() == "tp=2 pp=1 dp=2 cp=2 ep=4"
    assert dims.describe("name") == "tp2pp1dp2cp2ep4"
    assert dims.describe("record") == {"tp": 2, "pp": 1, "dp": 2, "cp": 2, "ep": 4}
    assert ParallelDims(dp=2, ep=2).describe("name") == "tp1pp1dp2ep2"
    # HSDP's replicas too: two runs that differ only there had one W&B name and one start-up line
    hsdp = ParallelDims(dp=4, dp_replicate=2)
    assert (hsdp.describe(), hsdp.describe("name")) == ("tp=1 pp=1 dp=4 dp_replicate=2", "tp1pp1dp4dp_replicate2")


@pytest.mark.parametrize("kwargs,message", [
    ({"tp": 0}, "parallel.tp=0 must be a positive integer"),
    ({"dp": 3, "ep": 2}, "parallel.ep=2 must divide dp*cp=3"),
])
def test_bad_degrees_are_refused_with_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        ParallelDims(**kwargs)


def test_bad_axes_and_coordinates_are_refused():
    dims = ParallelDims(dp=2, tp=2)
    with pytest.raises(ValueError, match="mix the expert view"):
        dims.groups("ep", "dp")
    with pytest.raises(ValueError, match="unknown parallel axes"):
        dims.groups("model")
    with pytest.raises(ValueError, match="outside a world of 4"):
        dims.coords(4)


def _hsdp_by_enumeration(pp: int, dp: int, cp: int, tp: int, replicas: int) -> dict[str, list[list[int]]]:
    """HSDP's groups found by walking the ranks in launch order (tp fastest, then cp, dp, pp) and
    cutting each (pp, tp) position's data-parallel ranks into `replicas` equal consecutive blocks:
    no coordinate arithmetic shared with ParallelDims."""
    data_parallel: dict[tuple[int, int], list[int]] = {}
    rank = 0
    for p in range(pp):
        for _ in range(dp * cp):
            for t in range(tp):
                data_parallel.setdefault((p, t), []).append(rank)
                rank += 1
    shard, replicate = [], []
    for ranks in data_parallel.values():
        blocks = [ranks[i:i + len(ranks) // replicas] for i in range(0, len(ranks), len(ranks) // replicas)]
        shard += blocks
        replicate += [list(column) for column in zip(*blocks)]
    return {"dp_shard": sorted(shard), "dp_replicate": sorted(replicate)}


def test_hsdp_replicas_dp4_tp2_written_out():
    """dp=4, dp_replicate=2, tp=2: FSDP shards over neighbouring data-parallel ranks and all-reduces
    across the two replicas; data is still read by all four dp ranks."""
    dims = ParallelDims(dp=4, tp=2, dp_replicate=2)
    assert dims.dp_shard == 2 and dims.size("dp_replicate") == 2 and dims.size("dp_shard") == 2
    assert dims.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # data sharding: unchanged by HSDP
    assert [dims.coord(r, "dp_replicate") for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.coord(r, "dp_shard") for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.coord(r, "dp") for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("degrees", [
    dict(dp=4, tp=2, dp_replicate=2), dict(pp=2, dp=2, cp=2, tp=2, dp_replicate=2),
    dict(dp=1, cp=4, dp_replicate=2), dict(pp=2, dp=3, cp=2, dp_replicate=3), dict(dp=4, dp_replicate=4),
    dict(dp=2, cp=2, tp=2, dp_replicate=1),
])
def test_hsdp_groups_match_an_enumeration_of_the_ranks(degrees):
    dims = ParallelDims(**degrees)
    expected = _hsdp_by_enumeration(dims.pp, dims.dp, dims.cp, dims.tp, dims.dp_replicate)
    for axis in ("dp_shard", "dp_replicate"):
        assert dims.groups(axis) == expected[axis], axis
        for ranks in expected[axis]:  # coordinates: constant across the other axis' group, distinct along it
            assert sorted(dims.coord(r, axis) for r in ranks) == list(range(len(ranks)))
    for ranks in expected["dp_shard"]:
        assert len({dims.coord(r, "dp_replicate") for r in ranks}) == 1
    # together the two axes are exactly the dense gradient-reduction group; dp (data) is untouched
    assert dims.groups("dp_replicate", "dp_shard") == dims.groups("dp", "cp")
    assert dims.groups("dp") == ParallelDims(**{**degrees, "dp_replicate": 1}).groups("dp")


def test_hsdp_replicas_are_refused_when_they_do_not_divide_or_mix_views():
    with pytest.raises(ValueError, match=r"parallel.dp_replicate=3 must divide dp\*cp=4"):
        ParallelDims(dp=4, dp_replicate=3)
    with pytest.raises(ValueError, match="parallel.dp_replicate=0 must be a positive integer"):
        ParallelDims(dp_replicate=0)
    dims = ParallelDims(dp=4, ep=2, dp_replicate=2)
    with pytest.raises(ValueError, match="mix the expert view"):
        dims.groups("ep", "dp_shard")
    with pytest.raises(ValueError, match="mix HSDP's view"):
        dims.groups("dp_replicate", "dp")


def test_layout_records_hold_tp_pp_dp_and_every_other_axis_only_above_one():
    """What checkpoints record: records written before cp, ep or HSDP existed hold none of them, and
    a layout without them must still match such a record."""
    assert ParallelDims(dp=4, tp=2).layout_record() == {"tp": 2, "pp": 1, "dp": 4}
    assert ParallelDims(pp=2, dp=2, cp=2, ep=4, tp=2, dp_replicate=2).layout_record() == \
        {"tp": 2, "pp": 2, "dp": 2, "cp": 2, "ep": 4, "dp_replicate": 2}
    assert ParallelDims(dp=2, cp=2, ep=2).degrees() == {"tp": 1, "pp": 1, "dp": 2, "cp": 2, "ep": 2}
    assert list(ParallelDims().degrees()) == ["tp", "pp", "dp", "cp", "ep"]  # the order resume lines list them


def test_a_layout_record_without_an_axis_means_that_axis_is_one():
    """Records list an axis only above 1 (and older records listed fewer axes): a record that leaves
    out an axis of degree 1 names the same layout as one that writes it, and any real difference in
    a degree or an engine key still tells the layouts apart (the rank's RNG streams come back only
    in the same layout, checkpoint/store.py)."""
    now = ParallelDims(pp=1, dp=4, cp=1, tp=1, ep=2).layout_record()
    assert ParallelDims.same_layout({"tp": 1, "pp": 1, "dp": 4, "ep": 2, "zero_stage": 3},
                                    {**now, "zero_stage": 3})
    one = ParallelDims(pp=1, dp=2, cp=1, tp=2).layout_record()
    assert ParallelDims.same_layout({"tp": 2, "pp": 1, "dp": 2, "cp": 1, "ep": 1, "dtype": "fp32"},
                                    {**one, "dtype": "fp32"})
    assert not ParallelDims.same_layout({"tp": 2, "pp": 1, "dp": 2, "dtype": "fp32"}, {**one, "dtype": "bf16"})
    assert not ParallelDims.same_layout({"tp": 1, "pp": 1, "dp": 4}, now)  # ep 1 vs 2
