"""Ctrl-C on a default run (Hydra's dated outputs/DATE/TIME directory): the closing line prints the
command that resumes it, and that command, run as printed by a shell, resumes it. "Run the same
command again" used to start from scratch in a new dated directory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import FRESH_RANKS, TINY, assert_ok, cli_env, read_metrics

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=60", "train.eval_interval=0"]


def test_a_sigint_default_run_prints_the_command_that_resumes_it(tmp_path):
    env = cli_env(**FRESH_RANKS)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # megaframe-train
    process = subprocess.Popen([sys.executable, "-m", "megaframe.train", *ARGS], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not [m for m in tmp_path.glob("outputs/*/*/metrics.jsonl") if len(read_metrics(m.parent)) >= 2]:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no steps logged"
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    (run_dir,) = [p.parent.resolve() for p in tmp_path.glob("outputs/*/*/metrics.jsonl")]
    closing = out.strip().splitlines()[-1]
    assert closing.startswith("megaframe: stopped by SIGINT at step "), closing
    stopped_at = int(closing.split("at step ")[1].split("/")[0])
    assert stopped_at < 60, "the run finished before the signal: nothing left to resume"
    (hint,) = [part for part in closing.split(" | ") if part.startswith("resume: ")]
    command = hint.removeprefix("resume: ")
    assert command == "megaframe-train " + " ".join(ARGS) + f" hydra.run.dir={run_dir}", command

    resumed = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert_ok(resumed)
    assert f"resumed from {run_dir / 'checkpoints' / f'global_step{stopped_at}'}" in resumed.stdout
    assert resumed.stdout.strip().splitlines()[-1].startswith("megaframe: finished at step 60/60")
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, 61))
    assert len(list(tmp_path.glob("outputs/*/*"))) == 1  # no second dated run


def test_a_refused_resume_offers_no_resume_command(tmp_path):
    """A resume refused on its checkpoint (here another global batch: exit 5) fails again when rerun
    as it was: its closing line names the last checkpoint and no `resume:` command (it printed the
    command that had just failed, before the error line that says what to change)."""
    from tests.support.helpers import run_cli

    run = [*TINY, "train.eval_interval=0", f"hydra.run.dir={tmp_path / 'run'}"]
    assert_ok(run_cli([*run, "train.max_steps=4", "train.exit_at_step=2"]))
    result = run_cli([*run, "train.max_steps=4", "parallel.global_batch_size=16"])
    assert result.returncode == 5, result.stderr[-2000:]
    closing = [line for line in result.stdout.splitlines() if line.startswith("megaframe: failed at step 2/4")]
    assert len(closing) == 1 and "| last checkpoint " in closing[0] and "resume:" not in closing[0], result.stdout
