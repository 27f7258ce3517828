"""megaframe/common/startup_signals.py: a stop signal while megaframe-train starts writes one line and
ends the process by the signal's default action; whoever restores the handlers after start-up
restores the default, not the start-up line."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.support.helpers import REPO, cli_env

KILL_SELF = """
import os, signal, sys, time
from megaframe.common.startup_signals import announce_stops_during_startup
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
announce_stops_during_startup()
os.kill(os.getpid(), signal.SIGHUP)  # ignored: goes on
print("alive", flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
time.sleep(30)
print("not stopped", flush=True)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
@pytest.mark.parametrize("rank", [None, "0", "1", "slurm 0", "slurm 3"])
def test_a_signal_during_startup_is_one_line_then_its_default_end(name, rank):
    """An srun task has SLURM_PROCID, its RANK only later (launch/slurm.py): every task spoke (review)."""
    if rank is None:
        env = cli_env()
    elif rank.startswith("slurm"):
        env = cli_env(SLURM_PROCID=rank.split()[1])
    else:
        env = cli_env(RANK=rank)
    result = subprocess.run([sys.executable, "-c", KILL_SELF, name], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == -getattr(signal, name), (result.returncode, result.stderr)
    assert result.stdout == "alive\n"
    line = f"megaframe-train: {name} during start-up: stopped before training, nothing saved\n"
    assert result.stderr == (line if rank in (None, "0", "slurm 0") else ""), result.stderr


def test_handlers_restored_after_startup_are_the_default_action():
    from megaframe.common.startup_signals import announce_stops_during_startup
    from megaframe.training.stop_signal import StopSignal

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    try:
        for signum in before:
            signal.signal(signum, signal.SIG_DFL)
        announce_stops_during_startup()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        stop = StopSignal(1).install()
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop.restore()
        assert all(signal.getsignal(signum) is signal.SIG_DFL for signum in before)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
