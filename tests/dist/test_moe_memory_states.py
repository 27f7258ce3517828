"""Expert parallelism's memory, measured: the model states DeepSpeed holds on a rank mid-step (bf16,
ZeRO-1, 2 and 3, dp=2) equal the planner's, which partitions dense parameters over dp x cp and
each rank's experts over their expert-data-parallel replicas, at ep=1 and at ep=2 (half the
experts per rank, their states then partitioned over no one); and at dp=4 ep=2 under ZeRO-3,
where each expert is partitioned over its 2 expert-data-parallel replicas, not the 4 dp ranks
(which hold two different sets of experts)."""
from __future__ import annotations

import pytest

from tests.support.memory_states import measure_moe_states
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow


def _assert_held_equals_planned(r: dict) -> None:
    what = f"ep={r['ep']} ZeRO-{r['stage']}: {r}"
    assert r["weights"] == pytest.approx(r["planned_weights"], rel=0.01), what
    assert r["optimizer"] == pytest.approx(r["planned_optimizer"], rel=0.05), what
    assert r["weights"] + r["gradients"] + r["optimizer"] == pytest.approx(
        r["planned_weights"] + r["planned_gradients"] + r["planned_optimizer"], rel=0.05), what


def test_held_states_with_experts_split_match_the_planner(tmp_path):
    cases = ((1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3))
    results = run_ranks(measure_moe_states, 2, tmp_path, timeout=900, run_root=str(tmp_path / "runs"), cases=cases)
    for rank_results in results:
        by = {(r["ep"], r["stage"]): r for r in rank_results}
        for r in rank_results:
            _assert_held_equals_planned(r)
        # ep=2 holds half the experts' weights; the experts are most of moe_tiny's weights
        assert by[(2, 1)]["weights"] < 0.75 * by[(1, 1)]["weights"]
        # ZeRO-3 at ep=2: no other rank holds these experts, so nothing partitions them (edp = 1)
        assert by[(2, 3)]["expert_partition_groups"] == [tuple(by[(2, 3)]["edp_ranks"])]
        assert len(by[(2, 3)]["edp_ranks"]) == 1


def test_zero3_partitions_experts_over_their_replicas(tmp_path):
    """dp=4 ep=2: ranks {0, 2} hold experts 0-3 and {1, 3} experts 4-7; ZeRO-3 must partition each
    set over its own two ranks (partitioned over all four, a rank would gather halves of other
    experts than its own)."""
    results = run_ranks(measure_moe_states, 4, tmp_path, timeout=900, run_root=str(tmp_path / "runs"), cases=((2, 3),))
    for rank, (r,) in enumerate(results):
        assert len(r["edp_ranks"]) == 2 and rank in r["edp_ranks"], r
        assert r["expert_partition_groups"] == [tuple(r["edp_ranks"])], r
        _assert_held_equals_planned(r)
