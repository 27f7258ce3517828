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


def test_a_point_with_parallel_auto_is_checked_from_a_layout_its_world_runs():
    """llama2_70b's tp=8 pp=4 on two nodes of 8: megaframe-train alone searches from tp=1 pp=1 dp=16
    (plan/search.validated_to_search), while the sweep's check refused the point before any launched."""
    from megaframe.launch.sweep import check_sweep_point

    point = ["recipe=llama2_70b", "cluster=h100_80g", "launcher=slurm", "launcher.nodes=2", "launcher.dry_run=true",
             "parallel.dp=null"]
    check_sweep_point([*point, "parallel=auto"])
    with pytest.raises(ConfigError, match="world size 16 is not divisible by parallel.tp\\*parallel.pp=32"):
        check_sweep_point(point)  # without parallel=auto the layout given is what would run


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


def test_a_points_torn_last_metrics_line_does_not_lose_the_sweeps_summary(tmp_path):
    """A point killed mid-write (SIGKILL, a full disk) leaves half a line: the summary takes the
    whole lines before it instead of ending the sweep with json's traceback."""
    from hydra_plugins.megaframe_launcher.local_launcher import _last_values

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "eval_loss": 2.25}\n[3]\n{"step": 3, "lo')
    assert _last_values(metrics) == {"loss": 2.5, "eval_loss": 2.25, "step": 2}


def test_a_point_a_signal_killed_outright_counts_as_exit_1(tmp_path):
    """subprocess gives -9 for a point the OOM killer ended, and sys.exit(-9) is exit 247: the sweep
    reports 1, as a run reports a rank killed by a signal."""
    import sys

    from hydra_plugins.megaframe_launcher.local_launcher import run_point

    code, stopped_by = run_point([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert (code, stopped_by) == (1, None)
    assert run_point([sys.executable, "-c", "raise SystemExit(8)"]) == (8, None)


def test_a_sweep_dir_that_cannot_be_made_is_one_line(tmp_path):
    """A file where hydra.sweep.dir should be was Hydra's traceback; hydra.run.dir's was one line."""
    from megaframe.launch.sweep import sweep_dir_problem

    (tmp_path / "a_file").write_text("x")
    for where, why in ((tmp_path / "a_file", "File exists"), (tmp_path / "a_file" / "sub", "Not a directory")):
        assert sweep_dir_problem(["-m", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={where}"]) == (
            f"hydra.sweep.dir={where}: cannot create the sweep directory ({why}); choose another")
    assert sweep_dir_problem([f"hydra.sweep.dir={tmp_path / 'new'}"]) is None and (tmp_path / "new").is_dir()
    # quoted as hydra_quoted writes it: the folder is the value Hydra reads, not the override's text
    assert sweep_dir_problem([f"hydra.sweep.dir='{tmp_path / 'my sweep'}'"]) is None
    assert (tmp_path / "my sweep").is_dir() and not list(tmp_path.glob("'*"))
    assert sweep_dir_problem(["hydra.sweep.dir=multirun/${now:%H-%M-%S}"]) is None  # Hydra resolves it
    assert not (tmp_path / "multirun").exists()
