"""launcher=slurm without a SLURM cluster: two local ranks that see only SLURM's variables train
the dp=2 curve, the job script for 2 nodes x 8 GPUs is the expected file, and a missing sbatch is
one line before anything starts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO, TINY, assert_ok, cli_env, free_port, read_metrics, run_cli
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=6", "train.eval_interval=3", "zero=stage1"]
# the job's nodes described, as launcher=slurm needs (never this host's measure): 2 ranks a node, 4 GiB each
CPU_NODES = ["cluster.gpus_per_node=2", "cluster.memory_gb=4"]


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
    args = ["launcher=slurm", "launcher.nodes=2", "launcher.cpus_per_task=12",
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
    result = run_cli(["launcher=slurm", "launcher.nodes=1", *CPU_NODES, *TINY,
                      f"hydra.run.dir={tmp_path}"], env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "launcher=slurm: no sbatch command on this host" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "submit.sbatch").exists()


def test_a_slurm_sweep_without_sbatch_submits_no_point(tmp_path):
    env = {**cli_env(), "PATH": os.path.dirname(sys.executable)}  # no sbatch on this PATH
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "optim.lr=1e-3,3e-3", "launcher=slurm", "launcher.nodes=1", *CPU_NODES,
                      *TINY, f"hydra.sweep.dir={sweep}"], env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "sweep point 0 (optim.lr=0.001): launcher=slurm: no sbatch command" in lines[0], lines
    assert not sweep.exists()


@pytest.mark.parametrize("bad", [["launcher.job_name=a\n#SBATCH --partition=x"], ["hydra.run.dir={tmp}/with space"]],
                         ids=["newline in a value", "space in the run dir"])
def test_a_job_script_that_would_break_is_refused_in_one_line_even_as_a_dry_run(tmp_path, bad):
    args = ["launcher=slurm", "launcher.nodes=1", *CPU_NODES, "launcher.dry_run=true", *TINY]
    overrides = [b.format(tmp=tmp_path) for b in bad]
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        overrides.append(f"hydra.run.dir={tmp_path}/run")
    result = run_cli([*args, *overrides])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaframe-train: error:"), lines
    assert not list(tmp_path.rglob("submit.sbatch"))


@pytest.mark.parametrize("args, said", [
    (["launcher=slurm", "launcher.nodes=8", "parallel.dp=64"], "launcher=slurm: the planner would measure this host "
     "(cluster=local), not the job's nodes; name their profile, cluster=h100_80g or cluster=a100_80g"),
    (["launcher=ray", "launcher.gpus_per_worker=1", "parallel.dp=64"], "launcher=ray with launcher.gpus_per_worker=1: "
     "the planner would measure this host (cluster=local), not the workers' GPUs; name their profile, cluster=h100_80g"),
    (["launcher=slurm", "cluster.memory_gb=80", "parallel.dp=64"], "launcher=slurm starts cluster.gpus_per_node ranks "
     "on each node, and cluster=local does not say how many; name the nodes' profile, cluster=h100_80g"),
    (["launcher=slurm", "launcher.nodes=8", "launcher.gpus_per_node=8"], "launcher.gpus_per_node is now "
     "cluster.gpus_per_node (a node's GPUs are the cluster's; cluster=h100_80g and cluster=a100_80g set 8): use "
     "cluster.gpus_per_node=8"),
    (["cluster=h100_80g", "cluster.nodes=8"], "cluster.nodes is now launcher.nodes"),
    (["hardware.peak_tflops=989"], "hardware.peak_tflops is now cluster.peak_tflops (one peak for MFU and the "
     "planner): use cluster.peak_tflops=989"),
])
def test_a_cluster_job_is_never_planned_on_this_host_and_old_keys_name_the_new(tmp_path, args, said):
    """Issue 34's 64-GPU path: a job whose ranks run elsewhere is refused, before anything is written,
    unless the cluster it runs on is named; the merged keys' old names say where they went."""
    result = run_cli(["recipe=llama2_7b", "launcher.dry_run=true", *args, f"hydra.run.dir={tmp_path}/run"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaframe-train: error: ") and said in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_the_64_gpu_job_as_the_readme_writes_it(tmp_path):
    """Llama-2-7B on 8 nodes of 8 H100s: planned for those GPUs, the job script for 64 tasks."""
    result = run_cli(["recipe=llama2_7b", "cluster=h100_80g", "launcher=slurm", "launcher.nodes=8", "parallel.dp=64",
                      "launcher.dry_run=true", f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    script = (tmp_path / "submit.sbatch").read_text().splitlines()
    for line in ("#SBATCH --nodes=8", "#SBATCH --ntasks=64", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in script, line
    srun = next(line for line in script if line.startswith("srun"))
    assert "cluster=h100_80g" in srun and "launcher" not in srun.split("megaframe.train", 1)[1]


def test_a_layout_that_fits_a_profile_but_not_this_host_names_the_profile(tmp_path):
    """The refusal that depends on the cluster names the cluster= option that fixes it."""
    result = run_cli(["recipe=llama2_7b", "parallel.dp=2", f"hydra.run.dir={tmp_path}/run"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does NOT fit on local" in lines[0], lines
    assert "; it fits cluster=a100_80g (peak " in lines[0] and "cluster=h100_80g (peak " in lines[0], lines
