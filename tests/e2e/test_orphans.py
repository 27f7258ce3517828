"""No rank outlives megaframe-train: SIGKILL of the launching process (the OOM killer, `kill -9`,
`timeout -k`) used to leave its ranks training under PID 1, writing checkpoints after the command
had exited 137. megaframe/launch/guard.py gives each rank the kernel's parent-death signal."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.support.helpers import FRESH_RANKS, REPO, TINY, cli_env

pytestmark = pytest.mark.slow


def _ranks_of(launcher_pid: int) -> list[psutil.Process]:
    """The launcher's descendants that run megaframe.train. Short-lived helpers (a compiler probe,
    `lscpu`) come and go while the ranks start: one gone between the listing and the read is skipped."""
    ranks = []
    for process in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "megaframe.train" in " ".join(process.cmdline()):
                ranks.append(process)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return ranks


def test_killing_the_launcher_outright_ends_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "megaframe.train", *TINY, "parallel.dp=2", "zero=stage1",
                                 "train.max_steps=100000", "train.eval_interval=0", f"hydra.run.dir={run_dir}"],
                                cwd=REPO, env=cli_env(**FRESH_RANKS), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # until both ranks train (a step is logged)
            ranks = _ranks_of(launcher.pid)
            if len(ranks) >= 2 and (run_dir / "metrics.jsonl").is_file():
                break
            assert launcher.poll() is None, "the run ended before it could be killed"
            time.sleep(0.5)
        assert len(ranks) >= 2, ranks
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone, not its process group
        launcher.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks outlived their launcher: {[p.pid for p in alive]}"
    finally:
        for process in [*ranks, psutil.Process(launcher.pid) if launcher.poll() is None else None]:
            if process is not None:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
