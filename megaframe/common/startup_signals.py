"""SIGTERM, SIGHUP or SIGUSR1 while megaframe-train starts: one line, then the signal's own end.

The run's stop handling (training/stop_signal.py, the launcher's agent) exists once the trainer or
the agent does, 2 s or more into a start (the imports alone). Before that the signal's default action
ended the process with no word: exit 143 and an empty log, which reads as a crash or a job that never
ran. The entry point installs this handler first; it writes the line and lets the default action end
the process as before (the same exit status, no Python clean-up, as the default action has none).
Whoever installs a handler later and restores the previous one afterwards restores the default in
place of this one (default_in_place_of_startup): past start-up, a line saying so would be wrong, and
a Python handler would be deaf while an exit callback hangs in C, where the default action is not.
"""
from __future__ import annotations

import os
import signal

from megaframe.common.failures import PROG

STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def announce_stops_during_startup() -> None:
    """At the entry point: the signals left at their default action get the start-up line."""
    for signum in STARTUP_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:  # an ignored signal (nohup's SIGHUP) stays ignored
            signal.signal(signum, _stopped_during_startup)


def _stopped_during_startup(signum: int, _frame) -> None:
    # rank 0 speaks for a job's ranks, as at a step boundary; an srun task has no RANK yet (launch/slurm.py)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        os.write(2, f"{PROG}: {signal.Signals(signum).name} during start-up: stopped before training, "
                    f"nothing saved\n".encode())
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def default_in_place_of_startup(handler):
    """The handler to restore where `handler` was replaced: the default action for this module's."""
    return signal.SIG_DFL if handler is _stopped_during_startup else handler
