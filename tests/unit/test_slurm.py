"""SLURM's variables mapped to torch's rendezvous, and hostlists."""
from __future__ import annotations

import pytest

from megaframe.config.schema import LauncherConfig
from megaframe.launch.slurm import adopt_slurm_env, first_host, sbatch_script, task_overrides


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
    script = sbatch_script(LauncherConfig(name="slurm"), 8, world, ["parallel.dp=2"], tmp_path)
    header = dict(line.removeprefix("#SBATCH --").split("=", 1) for line in script.splitlines()
                  if line.startswith("#SBATCH --") and "=" in line)
    assert (header["nodes"], header["ntasks"], header["ntasks-per-node"], header["gpus-per-node"]) == \
        (str(nodes), str(world), str(tasks_per_node), str(tasks_per_node))


def test_a_refused_submission_is_sbatchs_last_line(tmp_path, monkeypatch):
    from megaframe.launch.slurm import SubmitError, submit

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'sbatch: warning: x' >&2\necho 'sbatch: error: Invalid partition name specified' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    with pytest.raises(SubmitError) as refused:
        submit(tmp_path / "submit.sbatch")
    assert str(refused.value).endswith("submit.sbatch: sbatch: error: Invalid partition name specified")


@pytest.mark.parametrize("key, value", [("job_name", "x\n#SBATCH --partition=evil"), ("partition", "gpu\nrm -rf ~"),
                                        ("account", "my account"), ("time", "1:00:00\r"), ("job_name", "")])
def test_job_script_values_are_one_printable_word(key, value):
    """sbatch reads #SBATCH lines itself: a newline would add a line of the caller's choosing."""
    from megaframe.config.schema import TrainConfig
    from megaframe.config.validate import ConfigError, validate

    cfg = TrainConfig()
    cfg.launcher.name = "slurm"
    setattr(cfg.launcher, key, value)
    with pytest.raises(ConfigError, match=f"launcher.{key}=") as refused:
        validate(cfg, 1)
    assert "\n" not in str(refused.value).replace(repr(value), "")


@pytest.mark.parametrize("extra", ["--qos=high\nsrun evil", "qos=high", "--mail-user=a@b\x07"])
def test_sbatch_extra_entries_are_single_options(extra):
    from megaframe.config.schema import TrainConfig
    from megaframe.config.validate import ConfigError, validate

    cfg = TrainConfig()
    cfg.launcher.sbatch_extra = [extra]
    with pytest.raises(ConfigError, match="launcher.sbatch_extra entry"):
        validate(cfg, 1)


@pytest.mark.parametrize("time, good", [("forever", False), ("1h", False), ("2-", False), ("24:00:00", True),
                                        ("90", True), ("2-12:30", True), ("UNLIMITED", True)])
def test_a_time_limit_sbatch_would_refuse_is_one_line_before_submitting(time, good):
    """launcher.time=forever was written into the job script; sbatch refused it in its own words."""
    from megaframe.config.schema import TrainConfig
    from megaframe.config.validate import ConfigError, validate

    cfg = TrainConfig()
    cfg.launcher.name, cfg.launcher.time = "slurm", time
    cfg.cluster.gpus_per_node, cfg.cluster.memory_gb = 8, 80.0
    if good:
        validate(cfg, 1)
        return
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 1)
    assert str(refused.value).startswith(f"launcher.time={time}: not a SLURM time limit")


def test_well_formed_launcher_values_pass():
    from megaframe.config.schema import TrainConfig
    from megaframe.config.validate import validate

    cfg = TrainConfig()
    cfg.launcher.name, cfg.launcher.partition, cfg.launcher.time = "slurm", "gpu-h100", "24:00:00"
    cfg.launcher.sbatch_extra = ["--exclusive", "--constraint=h100&ib"]
    cfg.cluster.gpus_per_node, cfg.cluster.memory_gb = 8, 80.0  # the job's nodes, not this host
    validate(cfg, 1)


@pytest.mark.parametrize("run_dir", ["/tmp/my runs/a", "/tmp/r\u00e9sum\u00e9", "/tmp/a\nb", "/tmp/tab\there"])
def test_run_dirs_sbatch_cannot_take_are_refused(run_dir):
    from pathlib import Path

    from megaframe.launch.slurm import run_dir_problem

    problem = run_dir_problem(Path(run_dir))
    assert problem and problem.startswith("hydra.run.dir=") and "launcher=slurm" in problem


@pytest.mark.parametrize("run_dir", ["/scratch/job:1/a=b,c", "/scratch/it's", "/scratch/100%/x"])
def test_the_job_script_carries_any_printable_run_dir_to_hydra_and_sbatch(run_dir):
    """Hydra's grammar reads ':', '=', ',' and quotes; sbatch's --output reads '%'."""
    import shlex
    from pathlib import Path

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from megaframe.launch.slurm import run_dir_problem

    assert run_dir_problem(Path(run_dir)) is None
    script = sbatch_script(LauncherConfig(name="slurm"), 1, 1, [], Path(run_dir))
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    override = next(arg for arg in shlex.split(srun) if arg.startswith("hydra.run.dir="))
    assert OverridesParser.create().parse_override(override).value() == run_dir
    output = next(line for line in script.splitlines() if line.startswith("#SBATCH --output="))
    assert output == f"#SBATCH --output={run_dir.replace('%', '%%')}/slurm-%j.out"
