"""A rank that never starts (parallel/rendezvous.py): the ranks that did used to wait in gloo's or
NCCL's connect for train.collective_timeout_s (30 min), silent and deaf to SIGTERM. Now one waiting
line, then after train.join_timeout_s one error line and exit 7, and no process left behind."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tests.support.helpers import REPO, TINY, cli_env
from megaframe.backends.common import free_port

pytestmark = pytest.mark.slow


def _session(leader: int) -> list[psutil.Process]:
    """The processes still in the session `leader` started (start_new_session)."""
    left = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == leader:
                left.append(process)
        except (OSError, psutil.Error):
            continue
    return left


def test_a_rank_that_never_starts_ends_the_others_after_the_join_timeout(tmp_path):
    env = cli_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
    process = subprocess.Popen([sys.executable, "-m", "megaframe.train", *TINY, "parallel.dp=2", "zero=stage1",
                                "train.join_timeout_s=3", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 7, out[-2000:] + err[-3000:]
    lines = err.strip().splitlines()
    assert lines[0] == "megaframe: waiting for 1 of 2 ranks to join (rank 1; giving up after train.join_timeout_s=3)"
    assert len(lines) == 2 and lines[1].startswith(
        "megaframe-train: error (rank 0): 1 of 2 ranks did not join within train.join_timeout_s=3 (rank 1): "
        "check that they started"), err[-3000:]
    assert "[exit 7; traceback in " in lines[1]
    assert not _session(process.pid)
