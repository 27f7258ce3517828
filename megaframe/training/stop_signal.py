"""SIGINT, SIGTERM, SIGHUP and SIGUSR1 end a run at a step boundary, not in the middle of a collective.

Ctrl-C, `kill`, and SLURM's preemption (SIGTERM, then SIGKILL after the site's KillWait) used to
leave tracebacks from every rank and nothing saved; SIGHUP (a closed terminal, some schedulers) and
SIGUSR1 (SLURM's `--signal=USR1@90`, sent before the time limit) ended the run with no save at all.
Here the first signal only raises a flag; at the next step boundary the ranks agree (one MAX
all-reduce of the flag, since the signal reaches them at different moments) and all stop after the
same step, save when train.save_on_signal, print the closing line and exit 128 + the signal's number
(130 SIGINT, 143 SIGTERM, 129 SIGHUP, 138 SIGUSR1), as a shell reports a process the signal ended.

The watchdog: a rank that does not reach a step boundary within three of its slowest steps (at least
2 s) ends anyway, saving nothing: one stuck in a collective whose peer died (torchrun's agent stops
the survivors with SIGTERM), where waiting for the boundary would wait for the collective timeout.
It guards the step loop only: a checkpoint being written or an evaluation (`unguarded()`) takes as
long as it takes (a 7B save takes minutes, a step seconds), and start-up before the first timed step
is not guarded either (a resume's load is a save's size). While the rank waits for its peers to join
the process group (`joining()`), a signal ends it at once: nothing is written yet.
A second signal ends the rank at once, saving nothing: a save it interrupts is left in a tmp-*
directory, which is never taken for a checkpoint (checkpoint/store.py). The same signal again within
SAME_REQUEST_S is not a second one: SLURM's scancel and preemption signal every process of the job step,
the ranks too, and torchrun's agent passes its own copy on to them a moment later (that copy used to
stop every rank of an elastic or self-launched SLURM job without saving).
SIGQUIT (Ctrl-\\, and in torchrun's default list of signals its agent passes on to the ranks) means
"quit now": the rank ends at once, saving nothing, with one line and exit 131, rather than dumping
core in every rank.
A signal ignored when the process started (SIGHUP under `nohup`, SIGINT for a `&` job of a script)
stays ignored: the user asked that it not end the run.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megaframe.common.startup_signals import default_in_place_of_startup

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
QUIT = signal.SIGQUIT  # ends the rank at once: what Ctrl-\ asks for (no save)
GRACE_FLOOR_S = 2.0  # the least time a signalled rank is given to reach the next step boundary
SAME_REQUEST_S = 2.0  # the same signal again within this long is the same request (a copy passed on)
PROG = "megaframe-train"
# launcher=ray: the file the driver writes a signal's number into (launch/ray.py), which rank 0 takes as
# its own signal (StopSignal.watch_requests); set in the workers' environment
REQUEST_FILE_ENV = "MEGAFRAME_STOP_REQUEST_FILE"
REQUEST_POLL_S = 1.0  # how often rank 0 looks for it: one stat a second on one rank


def not_ignored(signals) -> tuple[int, ...]:
    """The signals whose disposition is not SIG_IGN now: `nohup` ignores SIGHUP so that a closed
    terminal leaves the run training, and a handler of ours would undo that."""
    return tuple(signum for signum in signals if signal.getsignal(signum) is not signal.SIG_IGN)


def exit_code(signum: int) -> int:
    """What a shell reports for a process that `signum` ended."""
    return 128 + int(signum)


def _exit_now(signum: int, why: str, every_rank: bool = False) -> None:
    """One line on stderr and the signal's exit code, at once (no Python clean-up: none is owed). The
    line is local rank 0's unless `every_rank`: the agent passes a second Ctrl-C to every rank, and a
    node of eight printed eight identical lines."""
    if every_rank or os.environ.get("LOCAL_RANK", "0") == "0":
        os.write(2, f"{PROG}: {signal.Signals(signum).name} {why}\n".encode())
    os._exit(exit_code(signum))


def _quit(signum: int, _frame) -> None:
    _exit_now(signum, "received: stopping now, without saving", every_rank=True)  # docs/failures.md: one per rank


@contextlib.contextmanager
def joining_before_the_run() -> Iterator[None]:
    """StopSignal.joining() for a join before the Trainer exists (cli.py's shared run dir, under
    torchrun or srun): a rank waiting for its peers ends on a signal with its line and code, not by
    the signal's default action; the previous handlers come back after the join."""
    stop = StopSignal(1).install()
    try:
        with stop.joining():
            yield
    finally:
        stop.restore()


class StopSignal:
    """The stop requested by a signal on this rank, and the ranks' agreement on it."""

    def __init__(self, world_size: int):
        self.received = 0  # the first signal's number, 0 while none came
        self._received_at = 0.0  # when it came (time.monotonic())
        self.world_size = world_size
        self._flag: Optional[torch.Tensor] = None  # made once, then filled in place at each check
        self._previous: dict[int, object] = {}
        self._slowest_step_s = 0.0  # 0 until a step was timed: nothing is guarded before
        self._guarding = True  # False inside unguarded(): a save or an evaluation
        self._joining = False  # inside joining(): a signal ends the rank at once
        self._stopping = False  # the ranks agreed to stop: the watchdog is done
        self._watchdog: Optional[threading.Timer] = None
        self._watching = threading.Event()  # set: watch_requests' thread ends (restore, the loop's end)

    def note_step(self, seconds: float) -> None:
        """How long a step took: a signalled rank waits three of the slowest for the next boundary."""
        self._slowest_step_s = max(self._slowest_step_s, seconds)
        self._arm()  # a signal during the first step is guarded from its end on

    def install(self) -> "StopSignal":
        """Catch the stop signals (main thread only: Ray Train runs the loop on a thread of its own,
        and the driver's signal reaches rank 0 as a file, watch_requests)."""
        if threading.current_thread() is threading.main_thread():
            for signum in not_ignored(SIGNALS):
                self._previous[signum] = signal.signal(signum, self._handle)
            for signum in not_ignored((QUIT,)):
                self._previous[signum] = signal.signal(signum, _quit)
        return self

    def restore(self) -> None:
        self._watching.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, default_in_place_of_startup(handler))
        self._previous.clear()
        self._disarm()

    def watch_requests(self) -> None:
        """launcher=ray: the driver's signal (Ctrl-C, `ray job stop`'s SIGTERM) in the file named by
        REQUEST_FILE_ENV, taken as this rank's own. Ray runs the loop on a thread of its own, where
        no handler can be installed, and its workers may be on other hosts; Ray killed them unsaved.
        Polled on a daemon thread (rank 0 alone: the ranks agree on the flag at the boundary) until
        the loop ends (finished) or the handlers go (restore). The thread only raises the flag: the
        watchdog is the step loop's to arm (note_step), never armed from here during a save."""
        if not (named := os.environ.get(REQUEST_FILE_ENV)):
            return

        def poll() -> None:
            while not self.received and not self._watching.is_set():
                try:
                    signum = int(open(named).read().strip())
                except (OSError, ValueError):  # not there (yet), or half written: look again
                    self._watching.wait(REQUEST_POLL_S)
                    continue
                if signum in SIGNALS and not self._watching.is_set():
                    self.received, self._received_at = signum, time.monotonic()
                return
        threading.Thread(target=poll, name="megaframe-stop-request", daemon=True).start()

    def finished(self) -> None:
        """The step loop ended (train.max_steps reached, or the stop agreed): no signal is waited for at
        a boundary any more, so none arms the watchdog (it used to end rank 0 in the run's last save or
        its closing barrier, two seconds after a signal that came in the last step), and the request
        watch ends."""
        self._stopping = True
        self._disarm()
        self._watching.set()

    def _handle(self, signum: int, _frame) -> None:
        if self._joining:
            _exit_now(signum, "while waiting for the ranks to join: stopping now (nothing to save yet)")
        if self.received:
            if signum == self.received and time.monotonic() - self._received_at < SAME_REQUEST_S:
                return  # the agent's copy of what reached this rank too: the same request
            _exit_now(signum, "again: stopping now, without saving")  # a second one: the user means now
        self.received, self._received_at = signum, time.monotonic()
        self._arm()

    @contextlib.contextmanager
    def joining(self) -> Iterator[None]:
        """While this rank waits for the others to join the process group: a signal ends it at once
        (a wait in C++ would otherwise hold the flag unseen until train.join_timeout_s)."""
        self._joining = True
        try:
            yield
        finally:
            self._joining = False

    @contextlib.contextmanager
    def unguarded(self) -> Iterator[None]:
        """A checkpoint save or an evaluation: a signal waits for it to finish; the watchdog (when a
        signal came) starts afresh after it, back in the step loop."""
        guarding, self._guarding = self._guarding, False
        self._disarm()
        try:
            yield
        finally:
            self._guarding = guarding
            self._arm()

    def _arm(self) -> None:
        """Start the watchdog when a signal is pending in the timed step loop (once)."""
        if (not self.received or self._stopping or not self._guarding or self._slowest_step_s <= 0
                or self._watchdog is not None):
            return
        # A rank that never reaches a step boundary (hung, or torchrun ending the others after one
        # failed) must still end: SIGTERM is also how the agent stops the ranks of a failed job.
        grace = max(GRACE_FLOOR_S, 3 * self._slowest_step_s)
        # every rank's line: the one that hung may not be local rank 0
        self._watchdog = threading.Timer(grace, _exit_now, (self.received, f"and no step boundary within {grace:.0f} s "
                                                            "(a rank hung?): stopping now, without saving"),
                                         {"every_rank": True})
        self._watchdog.daemon = True
        self._watchdog.start()

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

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
        if agreed:  # the boundary is reached: the save may take its time
            self._stopping = True
            self._disarm()

    @staticmethod
    def name(signum: Optional[int]) -> str:
        return signal.Signals(signum).name if signum else ""
