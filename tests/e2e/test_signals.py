"""SIGINT and SIGTERM end a run at a step boundary (megaframe/training/stop_signal.py): every rank stops
after the same step, saves it (train.save_on_signal), prints the closing line and exits 130/143,
with no traceback on the terminal. Ctrl-C at dp=2 used to print 245 lines and 4 tracebacks; SIGTERM
(SLURM's preemption) saved nothing. A rank that a signal killed is named with the signal."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.support.helpers import FRESH_RANKS, REPO, TINY, assert_ok, cli_env, read_metrics, run_cli

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=400", "train.eval_interval=0"]


def _start(args, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megaframe.train", *args], cwd=REPO, env=cli_env(**FRESH_RANKS, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_steps(process: subprocess.Popen, run_dir, steps: int) -> None:
    deadline = time.monotonic() + 240
    while not ((run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= steps):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no steps logged"
        time.sleep(0.2)


def _saved_steps(run_dir) -> list[int]:
    return sorted(int(p.name.removeprefix("global_step")) for p in (run_dir / "checkpoints").glob("global_step*"))


def test_ctrl_c_saves_the_last_step_and_the_run_resumes_from_it(tmp_path):
    run_dir = tmp_path / "run"
    process = _start([*ARGS, f"hydra.run.dir={run_dir}"])
    _wait_for_steps(process, run_dir, 3)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err and not err.strip(), err[-3000:]
    closing = out.strip().splitlines()[-1]
    assert closing.startswith("megaframe: stopped by SIGINT at step "), closing
    stopped_at = int(closing.split("at step ")[1].split("/")[0])
    assert _saved_steps(run_dir) == [stopped_at]  # save_interval=0: the signal's save alone
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, stopped_at + 1))
    resumed = run_cli([*ARGS, "train.max_steps=" + str(stopped_at + 2), "train.resume=auto", f"hydra.run.dir={run_dir}"])
    assert_ok(resumed)
    assert f"resumed from {run_dir / 'checkpoints' / f'global_step{stopped_at}'}" in resumed.stdout


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C", "SIGTERM to every process"])
def test_a_signal_at_dp2_stops_every_rank_at_one_step_and_saves_it(how, tmp_path):
    """SIGTERM to megaframe-train is what `kill` sends (the agent passes it to both ranks); Ctrl-C in a
    terminal sends SIGINT to the launcher's process group (torch starts the ranks in sessions of their
    own: the agent passes it on). SLURM's scancel and preemption signal every process of the job step,
    the ranks too, so each rank gets SIGTERM twice, its own and the agent's copy a moment later: that
    second copy used to stop the ranks at once, saving nothing. Each way: one stop, one save, no traceback."""
    run_dir = tmp_path / "run"
    process = _start([*ARGS, "parallel.dp=2", "zero=stage1", f"hydra.run.dir={run_dir}"])
    _wait_for_steps(process, run_dir, 2)
    ranks = [p for p in psutil.Process(process.pid).children(recursive=True) if "megaframe.train" in " ".join(p.cmdline())]
    name, code = ("SIGINT", 130) if how == "Ctrl-C" else ("SIGTERM", 143)
    if how == "Ctrl-C":
        os.killpg(process.pid, signal.SIGINT)  # _start made the launcher a process group leader
    elif how == "SIGTERM to every process":
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in out + err and not err.strip(), err[-3000:]
    closing = out.strip().splitlines()[-1]
    assert closing.startswith(f"megaframe: stopped by {name} at step "), closing
    stopped_at = int(closing.split("at step ")[1].split("/")[0])
    assert _saved_steps(run_dir) == [stopped_at]
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


def test_sigterm_to_one_rank_stops_them_all_and_save_on_signal_false_saves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    process = _start([*ARGS, "parallel.dp=2", "zero=stage1", "train.save_on_signal=false", f"hydra.run.dir={run_dir}"])
    _wait_for_steps(process, run_dir, 2)
    rank1 = next(p for p in psutil.Process(process.pid).children(recursive=True)
                 if p.environ().get("RANK") == "1" and "megaframe.train" in " ".join(p.cmdline()))
    rank1.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 143, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert out.strip().splitlines()[-1].startswith("megaframe: stopped by SIGTERM at step ")
    assert not (run_dir / "checkpoints").exists() or _saved_steps(run_dir) == []


def test_sigterm_during_the_imports_is_one_line_and_the_signals_exit(tmp_path):
    """0.6 s in, megaframe-train is still importing torch (2 s on the CI host): the default action ended
    it with no word at all (common/startup_signals.py)."""
    process = _start([*ARGS, f"hydra.run.dir={tmp_path / 'run'}"])
    time.sleep(0.6)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, (process.returncode, err[-3000:])  # the shell's 143
    assert err == "megaframe-train: SIGTERM during start-up: stopped before training, nothing saved\n", err[-3000:]
    assert not out and not (tmp_path / "run").exists()


def test_a_rank_killed_by_a_signal_is_named_with_it(tmp_path):
    result = run_cli([*TINY, "train.max_steps=6", "parallel.dp=2", "zero=stage1", f"hydra.run.dir={tmp_path / 'run'}"],
                     env=cli_env(MEGAFRAME_FAULTS="kill@3:1"))
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megaframe-train: error")]
    assert errors == ["megaframe-train: error (rank 1): killed by SIGKILL (the kernel's OOM killer sends it when "
                      "memory runs out: see `dmesg`) [exit 1]"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_rank_0_killed_by_a_signal_still_ends_with_a_closing_line(tmp_path):
    """Rank 0 prints the closing line: killed by the OOM killer, the job ended with the error line alone,
    without where it got to or how to resume."""
    run = tmp_path / "run"
    result = run_cli([*TINY, "train.max_steps=6", "train.save_interval=2", "parallel.dp=2", "zero=stage1",
                      f"hydra.run.dir={run}"], env=cli_env(MEGAFRAME_FAULTS="kill@4:0"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "megaframe-train: error (rank 0): killed by SIGKILL" in result.stderr
    closing = result.stdout.strip().splitlines()[-1]
    assert closing.startswith("megaframe: failed at step 3 (rank 0 killed: the step of metrics.jsonl's last "
                              "record) | last checkpoint "), closing
    assert f"{run / 'checkpoints' / 'global_step2'} | resume: megaframe-train " in closing, closing


@pytest.mark.parametrize("name, extra", [("SIGTERM", []), ("SIGUSR1", ["train.async_save=true"])])
def test_a_signal_during_a_save_lets_it_finish_then_stops_with_the_closing_line(name, extra, tmp_path):
    """SLURM's preemption (SIGTERM), or its --signal=USR1@90 before the time limit, while every rank
    writes the checkpoint of step 4, held open 3 s (faults.py slow_save; a 7B save takes minutes, a
    step seconds): the stop watchdog (three step times, at least 2 s) used to end the ranks mid-save,
    with no stop line, no closing line and tmp-global_step4 left; SIGUSR1 killed torchrun's agent
    and every rank unsaved. The synchronous save finishes and the ranks stop after step 4; the
    background one finishes while training goes on, and the stop saves its own step after it."""
    run_dir, stamps = tmp_path / "run", tmp_path / "stamps"
    stamps.mkdir()
    process = _start([*ARGS, "parallel.dp=2", "zero=stage1", "train.save_interval=4", *extra, f"hydra.run.dir={run_dir}"],
                     MEGAFRAME_FAULTS="slow_save@4", MEGAFRAME_FAULTS_STAMPS=str(stamps))
    deadline = time.monotonic() + 240
    while not (stamps / "save-rank0").exists():  # rank 0 is inside the save of step 4
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    ranks = [p for p in psutil.Process(process.pid).children(recursive=True) if "megaframe.train" in " ".join(p.cmdline())]
    signum = signal.Signals[name]
    process.send_signal(signum)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signum, out[-2000:] + err[-3000:]
    assert "Traceback" not in out + err and not err.strip(), err[-3000:]
    lines = out.strip().splitlines()
    closing = lines[-1]
    assert closing.startswith(f"megaframe: stopped by {name} at step "), closing
    stopped_at = int(closing.split("at step ")[1].split("/")[0])
    # synchronous: the save the signal waited for is the stop's; background: step 4's completed, and a
    # stop after a later step saved that step too
    assert stopped_at == 4 or (extra and stopped_at > 4), stopped_at
    assert _saved_steps(run_dir) == sorted({4, stopped_at})
    # a stop on a save-interval step (8, 12, ...) finds that step's periodic save done and saves nothing more
    saving = ", saving first" if stopped_at % 4 else ""
    assert f"megaframe: {name}: stopping after step {stopped_at}{saving}" in lines, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"global_step{stopped_at}"
    assert not list((run_dir / "checkpoints").glob("tmp-*"))
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
