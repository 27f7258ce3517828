"""megaframe/launch/sweep.py: the points a -m sweep runs, checked before any launches."""
from __future__ import annotations

import pytest

from megaframe.config.validate import ConfigError
from megaframe.launch.sweep import check_sweep, sweep_points

SWEEPS = [
    ["optim.lr=1e-3,3e-3", "parallel.dp=2", "zero=stage1", "train.max_steps=4"],
    ["optim.lr=choice(1e-3,3e-3)", "parallel.tp=1,2", "train.seed=range(0,3)"],
    ["model=gpt_tiny,llama_tiny", "precision=fp32"],
    ["train.max_steps=4"],
]


@pytest.mark.parametrize("overrides", SWEEPS)
def test_points_are_the_ones_hydras_basic_sweeper_runs_in_its_order(overrides):
    """Independent reference: Hydra's own BasicSweeper splitting the same overrides."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (hydra_points,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    assert sweep_points(overrides) == hydra_points


def test_the_failing_point_is_named_by_what_varies_and_later_points_are_not_checked():
    seen = []

    def check(point):
        seen.append(point)
        if "train.seed=1" in point:
            raise ConfigError("bad seed")

    with pytest.raises(ConfigError) as err:
        check_sweep(["optim.lr=1e-3", "train.seed=0,1,2"], check)
    assert str(err.value) == "sweep point 1 (train.seed=1): bad seed; nothing was launched"
    assert len(seen) == 2


def test_every_point_is_checked_when_all_are_good():
    seen = []
    assert check_sweep(["optim.lr=1e-3,3e-3", "train.seed=0,1"], seen.append) == 4
    assert seen == [["optim.lr=0.001", "train.seed=0"], ["optim.lr=0.001", "train.seed=1"],
                    ["optim.lr=0.003", "train.seed=0"], ["optim.lr=0.003", "train.seed=1"]]


@pytest.mark.parametrize("override, message", [
    ("optim.lr=interval(1e-4,1e-3)", "optim.lr: an interval sweep needs an optimising sweeper"),
    ("optim.lr=1e-3,,3", "Error parsing override 'optim.lr=1e-3,,3'"),
])
def test_sweeps_megaframe_cannot_run_are_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        check_sweep([override], lambda point: None)
    assert message in str(err.value) and "\n" not in str(err.value)
