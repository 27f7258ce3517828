"""`megaframe-train -m` sweeps at any layout (tests hydra_plugins/megaframe_launcher): each point
launches its own ranks in its own run directory and trains the curve it trains alone; a failed
point does not stop the others, and the sweep ends with its exit code and a summary."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from megaframe.config.compose import hydra_quoted
from tests.support.helpers import FRESH_RANKS, REPO, TINY, assert_ok, cli_env, read_metrics, run_cli
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=4", "train.eval_interval=2", "parallel.dp=2", "zero=stage1"]


def test_every_point_of_a_dp2_sweep_trains_its_own_curve(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "optim.lr=1e-3,3e-3", *ARGS, f"hydra.sweep.dir={sweep}"])
    assert_ok(result)
    assert result.stdout.count("launching 2 ranks") == 2
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [row["overrides"][0] for row in summary] == ["optim.lr=0.001", "optim.lr=0.003"]
    assert all(row["exit_code"] == 0 and row["step"] == 4 for row in summary)
    assert "sweep summary" in result.stdout
    # point 1 alone (point 0 differs only in optim.lr, and the eval losses below must differ)
    alone = tmp_path / "alone1"
    assert_ok(run_cli([*ARGS, "optim.lr=3e-3", f"hydra.run.dir={alone}"]))
    assert_parity(read_metrics(sweep / "1"), read_metrics(alone), "sweep point 1 against the same run alone")
    assert read_metrics(sweep / "0")[-1]["eval_loss"] != read_metrics(sweep / "1")[-1]["eval_loss"]


def test_a_point_that_fails_in_training_does_not_stop_the_sweep_and_sets_its_exit_code(tmp_path):
    """Rank 1 is killed at step 6: point 0 (8 steps) gets there, point 1 (4 steps) does not."""
    sweep = tmp_path / "sweep"
    env = {**cli_env(), "MEGAFRAME_FAULTS": "kill@6:1"}
    result = run_cli(["-m", *ARGS, "train.max_steps=8,4", f"hydra.sweep.dir={sweep}"], env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [row["exit_code"] for row in summary] == [1, 0]
    assert summary[1]["step"] == 4


@pytest.mark.parametrize("sweep_args, message", [
    (["parallel.tp=1,3"], "sweep point 1 (parallel.tp=3): parallel.tp=3 does not divide model.num_attention_heads=4"),
    (["optim.lrr=1e-3,3e-3"], "sweep point 0 (optim.lrr=0.001): unknown key 'optim.lrr'"),
    (["hydra/launcher=submitit_slurm", "optim.lr=1e-3,3e-3"], "megaframe submits SLURM jobs itself: launcher=slurm"),
    (["optim.lr=interval(1e-4,1e-3)"], "optim.lr: an interval sweep needs an optimising sweeper"),
    (["optim.lr=1e-3,3e-3", "parallel.global_batch_size=8,6"],
     "sweep point 1 (optim.lr=0.001 parallel.global_batch_size=6): parallel.global_batch_size=6 is not divisible"),
])
def test_a_point_that_cannot_run_stops_the_sweep_before_anything_launches(tmp_path, sweep_args, message):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", *ARGS, *sweep_args, f"hydra.sweep.dir={sweep}"])
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and message in error[0] and "nothing was launched" in error[0], result.stderr[-2000:]
    assert "launching" not in result.stdout and not sweep.exists()


def test_a_slurm_sweep_writes_one_job_per_point(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", "optim.lr=1e-3,3e-3", "launcher=slurm", "launcher.nodes=1", "cluster.gpus_per_node=2", "cluster.memory_gb=4",
                      "launcher.dry_run=true", *TINY, "zero=stage1", f"hydra.sweep.dir={sweep}"])
    assert_ok(result)
    scripts = [(sweep / str(point) / "submit.sbatch").read_text() for point in (0, 1)]
    for point, (script, lr) in enumerate(zip(scripts, ("optim.lr=0.001", "optim.lr=0.003"))):
        assert "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=2" in script
        assert lr in script and f"hydra.run.dir={(sweep / str(point)).resolve()}" in script
        assert "launcher" not in script.split("srun", 1)[1]  # the tasks train; they do not submit again


def test_a_sweep_over_the_options_of_ones_own_config_dir(tmp_path):
    """`-m --config-dir myconf model=a,b`: each point's own megaframe-train composes the directory's
    options too (Hydra leaves hydra.searchpath out of the points' overrides; without it every point
    ended "model=a: no such option", exit 2)."""
    for name, layers in (("a", 1), ("b", 2)):
        (tmp_path / "myconf" / "model").mkdir(parents=True, exist_ok=True)
        (tmp_path / "myconf" / "model" / f"{name}.yaml").write_text(
            f"arch: gpt2\nnum_layers: {layers}\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\n")
    sweep = tmp_path / "sweep"
    schedule = [a for a in TINY if not a.startswith("model.")]  # the shape is the options'
    result = run_cli(["-m", "--config-dir", str(tmp_path / "myconf"), "model=a,b", *schedule, "train.max_steps=2",
                      "train.eval_interval=2", f"hydra.sweep.dir={sweep}"])
    assert_ok(result)
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [(row["exit_code"], row["step"]) for row in summary] == [(0, 2), (0, 2)]
    assert [yaml.safe_load((sweep / p / "config.yaml").read_text())["model"]["num_layers"] for p in "01"] == [1, 2]


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM to the sweep after a failed point", "SIGKILL to the sweep"])
def test_a_signal_to_a_sweep_stops_the_running_point_as_it_stops_a_run(how, tmp_path):
    """Three points: a short one (killed by a one-shot fault in the SIGTERM case: exit 1), then a
    long one the signal reaches. Ctrl-C (SIGINT to the terminal's process group) or SIGTERM to the
    sweep: the running dp=2 point saves its step and exits 130 / 143 as a run does, the sweep writes
    its summary, starts no further point and exits with that code (not the earlier failure's 1).
    SIGKILL to the sweep: the point and its ranks die with it. Before, the sweep SIGKILLed the point
    0.25 s after a Ctrl-C (its ranks mid-save) and left it training on after a SIGTERM or SIGKILL,
    holding its run directory. The sweep directory's name needs Hydra's quoting (a space, a comma,
    parentheses), which the points' hydra.run.dir lacked."""
    sweep = tmp_path / "sweep, (v2)"
    args = [*ARGS, "train.max_steps=3,100000,100000", "train.eval_interval=0",
            f"hydra.sweep.dir={hydra_quoted(str(sweep))}"]
    faults = {}
    if how.startswith("SIGTERM"):
        (tmp_path / "stamps").mkdir()
        faults = {"MEGAFRAME_FAULTS": "kill@2:1", "MEGAFRAME_FAULTS_STAMPS": str(tmp_path / "stamps")}
    process = subprocess.Popen([sys.executable, "-m", "megaframe.train", "-m", *args],
                               cwd=REPO, env=cli_env(**FRESH_RANKS, **faults), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ((sweep / "1" / "metrics.jsonl").is_file() and len(read_metrics(sweep / "1")) >= 2):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "point 1 logged no steps"
        time.sleep(0.2)
    below = psutil.Process(process.pid).children(recursive=True)  # the point and its agent's ranks
    assert sum("megaframe.train" in " ".join(p.cmdline()) for p in below) == 3, [p.cmdline() for p in below]
    name, code = {"Ctrl-C": ("SIGINT", 130), "SIGTERM to the sweep after a failed point": ("SIGTERM", 143),
                  "SIGKILL to the sweep": ("SIGKILL", None)}[how]
    if how == "Ctrl-C":
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(getattr(signal, name))
    if how == "SIGKILL to the sweep":  # (communicate() would wait for an orphaned point's end of the pipes)
        process.wait(timeout=30)
        _, alive = psutil.wait_procs(below, timeout=20)
        assert not alive, f"left running after the sweep was killed: {[p.cmdline()[-1] for p in alive]}"
        process.communicate(timeout=60)
        return
    out, err = process.communicate(timeout=300)
    assert process.returncode == code, err[-3000:]
    _, alive = psutil.wait_procs(below, timeout=20)
    assert not alive, f"left running after the sweep ended: {[p.pid for p in alive]}"
    assert not (sweep / "2").exists(), "a point started after the stop"
    assert "Traceback" not in out + err, err[-3000:]
    assert f"sweep stopped by {name} during point 1; 1 point(s) did not start" in err, err[-3000:]
    first, stopped = json.loads((sweep / "sweep_summary.json").read_text())
    assert first["exit_code"] == (1 if faults else 0), first
    saved = sorted(p.name for p in (sweep / "1" / "checkpoints").glob("global_step*"))
    assert stopped["exit_code"] == code and saved == [f"global_step{stopped['step']}"], (stopped, saved)
