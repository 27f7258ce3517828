"""The launcher's variables are checked before a rank joins (megaframe/common/launch_env.py): one line and
exit 2, where torch's env:// join ended in C++ stack dumps (RANK >= WORLD_SIZE) or a traceback."""
from __future__ import annotations

import pytest

from megaframe.launch.main import train_main
from megaframe.common.launch_env import launch_env_problem

OK = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
      "MASTER_PORT": "29500"}


@pytest.mark.parametrize("change, problem", [
    ({"RANK": "-1"}, "RANK=-1 must be in [0, WORLD_SIZE=4)"),
    ({"RANK": "4"}, "RANK=4 must be in [0, WORLD_SIZE=4)"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"WORLD_SIZE": "four"}, "WORLD_SIZE='four' is not an integer"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be in [0, LOCAL_WORLD_SIZE=2)"),
    ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 must be in [1, WORLD_SIZE=4]"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 must be >= 0"),
    ({"MASTER_PORT": None}, "MASTER_PORT is not set, and WORLD_SIZE=4 ranks need it"),
    ({"MASTER_ADDR": " "}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be a TCP port in [1, 65535]"),
    ({"RANK": None}, "WORLD_SIZE=4 is set but RANK is not"),
    ({"WORLD_SIZE": None}, "RANK=1 is set but WORLD_SIZE is not"),
])
def test_contradicting_launcher_variables_are_named(change, problem):
    env = {k: v for k, v in {**OK, **change}.items() if v is not None}
    found = launch_env_problem(env)
    assert found is not None and found.startswith(problem), found
    assert "the launcher (torchrun, srun) sets them" in found


@pytest.mark.parametrize("env", [OK, {}, {"RANK": "0", "WORLD_SIZE": "1"}, {"LOCAL_RANK": "0"},
                                 {**OK, "LOCAL_WORLD_SIZE": None},
                                 # one device seen (SLURM --gpus-per-task): its local rank counts the node's tasks
                                 {**OK, "LOCAL_WORLD_SIZE": None, "LOCAL_RANK": "5"}])
def test_a_consistent_launch_or_none_passes(env):
    assert launch_env_problem({k: v for k, v in env.items() if v is not None}) is None


def test_megaframe_train_refuses_them_in_one_line_before_composing(monkeypatch, capsys):
    for name, value in {**OK, "RANK": "7"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        train_main(["model=no_such_model"])  # not composed: the launch is refused first
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megaframe-train: error: RANK=7 must be in [0, WORLD_SIZE=4)"), err
