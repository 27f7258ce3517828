"""SLURM's variables mapped to torch's rendezvous, and hostlists."""
from __future__ import annotations

import pytest

from megaframe.slurm import adopt_slurm_env, first_host, task_overrides


@pytest.mark.parametrize("nodelist, host", [("node7", "node7"), ("gpu[003-010,012],cpu1", "gpu003"),
                                            ("a[1,3],b[2-4]", "a1"), ("rack1-n[08-09]-ib", "rack1-n08-ib")])
def test_first_host_of_a_hostlist(nodelist, host):
    assert first_host(nodelist) == host


def test_an_srun_task_gets_torchrun_variables():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[003-004]",
           "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456", "SLURM_TASKS_PER_NODE": "8(x2)"}
    assert adopt_slurm_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("9", "16", "1", "8")
    assert env["MASTER_ADDR"] == "gpu003" and env["MASTER_PORT"] == str(10000 + 123456 % 20000)


@pytest.mark.parametrize("drop", ["SLURM_STEP_ID", "SLURM_PROCID"])
def test_not_an_srun_task_or_already_under_torchrun_changes_nothing(drop):
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n1",
           "SLURM_STEP_ID": "0"}
    del env[drop]  # the batch script itself has no step id
    assert not adopt_slurm_env(dict(env)) and "RANK" not in env
    under_torchrun = {**env, drop: "0", "RANK": "3", "WORLD_SIZE": "4"}
    assert not adopt_slurm_env(under_torchrun) and under_torchrun["RANK"] == "3"


def test_tasks_do_not_submit_again():
    assert task_overrides(["launcher=slurm", "launcher.nodes=2", "model=x", "hydra.run.dir=/a", "launcher_x=1"]) == \
        ["model=x", "launcher_x=1"]
