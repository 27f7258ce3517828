"""The first SIGINT/SIGTERM only raises a flag; a rank that then never reaches a step boundary (hung,
or stopped by torchrun's agent because a peer failed) still ends, within its grace."""
from __future__ import annotations

import subprocess
import sys
import time

from helpers import REPO

_NO_BOUNDARY = """
import os, signal, time
from megaframe.training import stop_signal
stop_signal.GRACE_FLOOR_S = 0.5
stop = stop_signal.StopSignal(1).install()
stop.note_step(0.01)
os.kill(os.getpid(), signal.SIGTERM)
print("flagged", stop.received, flush=True)
time.sleep(60)  # a rank stuck outside the loop
"""

_AT_BOUNDARY = """
import os, signal, time, torch
from megaframe.training import stop_signal
stop_signal.GRACE_FLOOR_S = 0.5
stop = stop_signal.StopSignal(1).install()
os.kill(os.getpid(), signal.SIGINT)
print("agreed", stop.agreed(torch.device("cpu")), flush=True)
time.sleep(1.5)  # a save after the boundary: the watchdog no longer runs
print("saved", flush=True)
"""


def _run(code: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    return result, time.monotonic() - start


def test_a_signalled_rank_that_reaches_no_boundary_ends_after_its_grace():
    result, took = _run(_NO_BOUNDARY)
    assert result.stdout.strip() == "flagged 15", result.stderr[-2000:]
    assert result.returncode == 143 and took < 30, (result.returncode, took)


def test_the_boundary_disarms_the_watchdog_so_the_save_can_finish():
    result, _ = _run(_AT_BOUNDARY)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["agreed", "2", "saved"]
