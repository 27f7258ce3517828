"""tests/support/composed.py: run_ranks composes each run once before it forks, and the ranks get
copies of that config, equal to what they would have composed themselves."""
from __future__ import annotations

import pytest

from megaframe.config.compose import compose
from megaframe.config.validate import ConfigError
from tests.support import composed as composed_module
from tests.support.composed import compose_before_fork, composed
from tests.support.helpers import TINY
from tests.support.ranks import run_ranks

RUN = [*TINY, "model=llama_tiny", "train.max_steps=3"]


@pytest.fixture
def memo(monkeypatch):
    monkeypatch.setattr(composed_module, "_COMPOSED", {})
    return composed_module._COMPOSED


def _hidden_and_layers(rank: int, world: int, runs: list, overrides: list) -> tuple:
    """In a forked rank, with megaframe's compose broken: what composed() hands out."""
    import megaframe.config.compose as compose_module

    def broken(*args, **kwargs):
        raise AssertionError("a rank composed again")

    compose_module.compose = broken
    return tuple(composed(o).model.hidden_size for o in (runs[0][0], overrides))


def test_ranks_take_the_configs_composed_before_the_fork(memo, tmp_path):
    other = [*RUN, "model.hidden_size=32"]
    got = run_ranks(_hidden_and_layers, 1, tmp_path, runs=[(RUN, str(tmp_path / "run"))], overrides=other)
    assert got == [(64, 32)]
    assert set(memo) == {tuple(RUN), tuple(other)}


def test_each_caller_gets_its_own_copy_equal_to_a_fresh_compose(memo):
    compose_before_fork({"runs": [(RUN, "unused")]})
    first, second = composed(RUN), composed(RUN)
    assert first == second == compose(RUN)[0] and first is not second
    first.model.hidden_size = 8  # a rank changing its config changes no other's
    assert composed(RUN).model.hidden_size == 64


def test_a_failing_composition_is_left_to_the_rank(memo):
    bad = [*RUN, "model.no_such_key=1"]
    compose_before_fork({"overrides": bad})  # not here: the rank reports it, as before
    assert memo == {}
    with pytest.raises(ConfigError, match="no_such_key"):
        composed(bad)


def test_runs_of_other_shapes_are_left_to_their_ranks(memo):
    """run_ranks hands `runs` on as each test shaped it: triples (test_document_mask_layouts) and a
    dict of run dirs (test_hf_export) are not (overrides, run_dir) pairs, and nothing is composed."""
    compose_before_fork({"runs": [(RUN, ["packed"], "dir")]})
    compose_before_fork({"runs": {"llama": "dir", "gpt2": "dir"}})
    compose_before_fork({"runs": [(RUN, "dir"), ("not", "overrides")]})
    assert set(memo) == {tuple(RUN)}
