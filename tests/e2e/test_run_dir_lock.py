"""A run directory has one owner (megaframe/common/run_lock.py). Two megaframe-train processes on one run
dir used to both resume from the same checkpoint, rewrite the same checkpoints and `latest`, and
append duplicate steps to metrics.jsonl."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO, TINY, assert_ok, cli_env, read_metrics, run_cli

pytestmark = pytest.mark.slow


def _snapshot(run_dir):
    """Every file under the run dir with its bytes (what a second writer must not touch)."""
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".megaframe.lock"}


def test_a_second_run_on_a_busy_run_dir_is_refused_and_the_owner_keeps_it(tmp_path):
    run_dir, stamps = tmp_path / "run", tmp_path / "stamps"
    stamps.mkdir()
    args = [*TINY, "train.max_steps=6", "train.save_interval=1", "train.eval_interval=0", f"hydra.run.dir={run_dir}"]
    owner = subprocess.Popen([sys.executable, "-m", "megaframe.train", *args], cwd=REPO,
                             env=cli_env(MEGAFRAME_FAULTS="hang@4", MEGAFRAME_FAULTS_STAMPS=str(stamps)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (stamps / "hang-rank0").exists():  # three steps saved, the owner busy in step 4
            assert owner.poll() is None and time.monotonic() < deadline, "the owner ended before step 4"
            time.sleep(0.3)
        before = _snapshot(run_dir)
        second = run_cli([*args, "train.resume=auto"])
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"is in use by pid {owner.pid}" in lines[0] and "hydra.run.dir" in lines[0], lines[0]
        assert _snapshot(run_dir) == before  # nothing written, not even Hydra's .hydra/ files
    finally:
        os.killpg(owner.pid, signal.SIGKILL)  # the owner dies without any cleanup
        owner.wait()
    resumed = run_cli([*args, "train.resume=auto"])  # the kernel released the dead owner's lock
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and "global_step3" in resumed.stdout, resumed.stdout
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step once


def test_ranks_under_torchrun_refuse_a_busy_run_dir_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from megaframe.common import run_lock; "
                               "assert run_lock.acquire(sys.argv[1]) is None; print('held', flush=True); "
                               "time.sleep(600)", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        owners = "the running job's config, which megaframe-eval reads back\n"
        (run_dir / "config.yaml").write_text(owners)
        result = run_cli([*TINY, "parallel.dp=2", "zero=stage1", "train.max_steps=2", f"hydra.run.dir={run_dir}"],
                         launcher=["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"])
        assert result.returncode != 0
        refusals = [line for line in result.stderr.splitlines() if "megaframe-train: error" in line]
        assert len(refusals) == 1 and f"is in use by pid {holder.pid}" in refusals[0], result.stderr[-3000:]
        assert "[exit 2" in refusals[0]
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
        assert (run_dir / "config.yaml").read_text() == owners  # rank 0 wrote it before it was refused
    finally:
        holder.kill()
        holder.wait()
