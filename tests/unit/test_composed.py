"""tests/support/composed.py: run_ranks composes the runs of a rank function marked @composes_runs
once before it forks, and the ranks get copies of that config, equal to what they would have composed
themselves; an unmarked rank function's arguments are not read."""
from __future__ import annotations

import pytest

from megaframe.config.compose import compose
from megaframe.config.validate import ConfigError
from tests.support import composed as composed_module
from tests.support.composed import compose_before_fork, composed, composes_runs
from tests.support.helpers import TINY
from tests.support.ranks import run_ranks

RUN = [*TINY, "model=llama_tiny", "train.max_steps=3"]


@pytest.fixture
def memo(monkeypatch):
    monkeypatch.setattr(composed_module, "_COMPOSED", {})
    return composed_module._COMPOSED


@composes_runs
def _hidden_sizes(rank: int, world: int, runs: list) -> tuple:
    """In a forked rank, with megaframe's compose broken: what composed() hands out."""
    import megaframe.config.compose as compose_module

    def broken(*args, **kwargs):
        raise AssertionError("a rank composed again")

    compose_module.compose = broken
    return tuple(composed(overrides).model.hidden_size for overrides, _ in runs)


def test_ranks_take_the_configs_composed_before_the_fork(memo, tmp_path):
    other = [*RUN, "model.hidden_size=32"]
    got = run_ranks(_hidden_sizes, 1, tmp_path, runs=[(RUN, str(tmp_path / "run")), (other, str(tmp_path / "other"))])
    assert got == [(64, 32)]
    assert set(memo) == {tuple(RUN), tuple(other)}


def test_each_caller_gets_its_own_copy_equal_to_a_fresh_compose(memo):
    compose_before_fork(_hidden_sizes, {"runs": [(RUN, "unused")]})
    first, second = composed(RUN), composed(RUN)
    assert first == second == compose(RUN)[0] and first is not second
    first.model.hidden_size = 8  # a rank changing its config changes no other's
    assert composed(RUN).model.hidden_size == 64


def test_a_failing_composition_is_left_to_the_rank(memo):
    bad = [*RUN, "model.no_such_key=1"]
    compose_before_fork(_hidden_sizes, {"runs": [(bad, "unused")]})  # not here: the rank reports it, as before
    assert memo == {}
    with pytest.raises(ConfigError, match="no_such_key"):
        composed(bad)


def _composes_for_itself(rank: int, world: int, runs) -> None:
    """Unmarked: its `runs` may have any shape (triples in test_document_mask_layouts, a dict of run
    dirs in test_hf_export)."""


def test_an_unmarked_rank_function_is_left_to_compose_for_itself(memo):
    compose_before_fork(_composes_for_itself, {"runs": [(RUN, "dir")]})
    compose_before_fork(_composes_for_itself, {"runs": {"llama": "dir"}, "overrides": RUN})
    assert memo == {}
