"""launcher=slurm without a SLURM cluster: two local ranks that see only SLURM's variables train
the dp=2 curve, the job script for 2 nodes x 8 GPUs is the expected file, and a missing sbatch is
one line before anything starts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, TINY, assert_ok, cli_env, free_port, read_metrics, run_cli
from parity import assert_parity

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=6", "train.eval_interval=3", "zero=stage1"]


def test_two_srun_tasks_train_the_dp2_curve(tmp_path):
    reference, tasks_dir = tmp_path / "reference", tmp_path / "slurm"
    assert_ok(run_cli([*ARGS, "parallel.dp=2", f"hydra.run.dir={reference}"]))
    port = str(free_port())
    procs = []
    for task in range(2):
        env = {k: v for k, v in cli_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
        env.update(SLURM_PROCID=str(task), SLURM_NTASKS="2", SLURM_LOCALID=str(task), SLURM_NTASKS_PER_NODE="2",
                   SLURM_JOB_NODELIST="localhost", SLURM_STEP_ID="0", SLURM_JOB_ID="4242", MASTER_PORT=port,
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "megaframe.train", *ARGS, f"hydra.run.dir={tasks_dir}"],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-2000:]
    assert "launching" not in outputs[0][0]  # the tasks are the ranks: nothing self-launched
    assert_parity(read_metrics(tasks_dir), read_metrics(reference), "2 SLURM tasks against dp=2")


def test_the_job_script_for_two_nodes_of_eight_gpus(tmp_path):
    args = ["launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=8", "launcher.cpus_per_task=12",
            "launcher.partition=gpu", "launcher.account=lm", "launcher.time=24:00:00", "launcher.job_name=llama-pretrain",
            "launcher.sbatch_extra=[--exclusive]", "launcher.dry_run=true", "cluster=h100_80g", "model=llama_tiny",
            "zero=stage1", "parallel.tp=2", "parallel.global_batch_size=256", "optim.betas=[0.9, 0.95]",
            f"hydra.run.dir={tmp_path}"]
    result = run_cli(args)
    assert_ok(result)
    assert "not submitted" in result.stdout
    written = (tmp_path / "submit.sbatch").read_text()
    expected = (Path(__file__).parent / "expected" / "slurm_2nodes_8gpus.sbatch").read_text()
    assert written == expected.replace("PYTHON", sys.executable).replace("RUN_DIR", str(tmp_path.resolve()))


def test_no_sbatch_is_one_line_before_anything_starts(tmp_path):
    env = {**cli_env(), "PATH": os.path.dirname(sys.executable)}  # no sbatch on this PATH
    result = run_cli(["launcher=slurm", "launcher.nodes=1", "launcher.gpus_per_node=2", *TINY,
                      f"hydra.run.dir={tmp_path}"], env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "launcher=slurm: no sbatch command on this host" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "submit.sbatch").exists()


def test_a_slurm_sweep_without_sbatch_submits_no_point(tmp_path):
    env = {**cli_env(), "PATH": os.path.dirname(sys.executable)}  # no sbatch on this PATH
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "optim.lr=1e-3,3e-3", "launcher=slurm", "launcher.nodes=1", "launcher.gpus_per_node=2",
                      *TINY, f"hydra.sweep.dir={sweep}"], env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "sweep point 0 (optim.lr=0.001): launcher=slurm: no sbatch command" in lines[0], lines
    assert not sweep.exists()


@pytest.mark.parametrize("bad", [["launcher.job_name=a\n#SBATCH --partition=x"], ["hydra.run.dir={tmp}/with space"]],
                         ids=["newline in a value", "space in the run dir"])
def test_a_job_script_that_would_break_is_refused_in_one_line_even_as_a_dry_run(tmp_path, bad):
    args = ["launcher=slurm", "launcher.nodes=1", "launcher.gpus_per_node=2", "launcher.dry_run=true", *TINY]
    overrides = [b.format(tmp=tmp_path) for b in bad]
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        overrides.append(f"hydra.run.dir={tmp_path}/run")
    result = run_cli([*args, *overrides])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaframe-train: error:"), lines
    assert not list(tmp_path.rglob("submit.sbatch"))
