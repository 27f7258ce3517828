"""SIGINT and SIGTERM end a run at a step boundary, not in the middle of a collective.

Ctrl-C, `kill`, and SLURM's preemption (SIGTERM, then SIGKILL after the site's KillWait) used to
leave tracebacks from every rank and nothing saved. Here the first signal only raises a flag; at
the next step boundary the ranks agree (one MAX all-reduce of the flag, since the signal reaches
them at different moments) and all stop after the same step, save when train.save_on_signal,
print the closing line and exit 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a
shell reports a process the signal ended. A second signal stops the rank at once, saving nothing, and
so does a rank that does not reach a step boundary within three of its slowest steps (at least 2 s):
one stuck outside the loop, or one torchrun's agent stops with SIGTERM because a peer failed.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_FLOOR_S = 2.0  # the least time a signalled rank is given to reach the next step boundary


def exit_code(signum: int) -> int:
    """What a shell reports for a process that `signum` ended."""
    return 128 + int(signum)


class StopSignal:
    """The stop requested by a signal on this rank, and the ranks' agreement on it."""

    def __init__(self, world_size: int):
        self.received = 0  # the first signal's number, 0 while none came
        self.world_size = world_size
        self._flag: Optional[torch.Tensor] = None  # made once, then filled in place at each check
        self._previous: dict[int, object] = {}
        self._slowest_step_s = 0.0
        self._watchdog: Optional[threading.Timer] = None

    def note_step(self, seconds: float) -> None:
        """How long a step took: a signalled rank waits three of the slowest for the next boundary."""
        self._slowest_step_s = max(self._slowest_step_s, seconds)

    def install(self) -> "StopSignal":
        """Catch SIGINT and SIGTERM (main thread only: Ray Train runs the loop on a thread of its own,
        and Ray stops its workers itself)."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame) -> None:
        if self.received:  # the second one: the user means now
            os.write(2, f"megaframe-train: {signal.Signals(signum).name} again: stopping now, without saving\n"
                     .encode())
            os._exit(exit_code(signum))
        self.received = signum
        # A rank that never reaches a step boundary (hung, or torchrun ending the others after one
        # failed) must still end: SIGTERM is also how the agent stops the ranks of a failed job.
        grace = max(GRACE_FLOOR_S, 3 * self._slowest_step_s)
        self._watchdog = threading.Timer(grace, os._exit, (exit_code(signum),))
        self._watchdog.daemon = True
        self._watchdog.start()

    def agreed(self, device: torch.device) -> int:
        """The signal any rank has received (the highest number when several), 0 for none. Every
        rank calls this at the same step boundary: one all-reduce of four bytes, read by the host
        right after the step's loss has already been read."""
        if self.world_size == 1:
            self._at_boundary(self.received)
            return self.received
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._flag.fill_(self.received)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        agreed = int(self._flag.item())
        self._at_boundary(agreed)
        return agreed

    def _at_boundary(self, agreed: int) -> None:
        if agreed and self._watchdog is not None:  # the boundary is reached: the save may take its time
            self._watchdog.cancel()

    @staticmethod
    def name(signum: Optional[int]) -> str:
        return signal.Signals(signum).name if signum else ""
