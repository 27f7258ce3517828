"""SLURM's variables mapped to torch's rendezvous, and hostlists."""
from __future__ import annotations

import pytest

from megaframe.config.schema import LauncherConfig
from megaframe.slurm import adopt_slurm_env, first_host, sbatch_script, task_overrides


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


@pytest.mark.parametrize("world, nodes, tasks_per_node", [(2, 1, 2), (8, 1, 8), (16, 2, 8), (32, 4, 8)])
def test_the_job_asks_for_one_task_per_rank_of_the_layout(world, nodes, tasks_per_node, tmp_path):
    """Without launcher.nodes the job holds exactly the layout's ranks: a dp=2 job on 8-GPU nodes is
    2 tasks on 2 GPUs (8 tasks would each find a world size of 8 the layout does not have)."""
    script = sbatch_script(LauncherConfig(name="slurm", gpus_per_node=8), world, ["parallel.dp=2"], tmp_path)
    header = dict(line.removeprefix("#SBATCH --").split("=", 1) for line in script.splitlines()
                  if line.startswith("#SBATCH --") and "=" in line)
    assert (header["nodes"], header["ntasks"], header["ntasks-per-node"], header["gpus-per-node"]) == \
        (str(nodes), str(world), str(tasks_per_node), str(tasks_per_node))


def test_a_refused_submission_is_sbatchs_last_line(tmp_path, monkeypatch):
    from megaframe.slurm import SubmitError, submit

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'sbatch: warning: x' >&2\necho 'sbatch: error: Invalid partition name specified' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    with pytest.raises(SubmitError) as refused:
        submit(tmp_path / "submit.sbatch")
    assert str(refused.value).endswith("submit.sbatch: sbatch: error: Invalid partition name specified")
