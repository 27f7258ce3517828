"""How megaframe-preprocess ends on a signal: SIGINT (Ctrl-C), SIGTERM (kill, a scheduler's time
limit) and SIGHUP (a closed terminal) raise Stopped in the main thread, so the writers' context
managers remove their temp files (which grow as large as the output) and the worker pool is
terminated; the previous dataset under the output prefix is left as it was. A signal ignored at
start (SIGHUP under `nohup`) stays ignored.

A signal that arrives while the datasets are being moved into place (commit: .json removed, then
.bin, .idx and .json renamed) waits until that is done: stopped midway, the old dataset would be
gone and the new one incomplete. Stopped after that, the tool reports the datasets it wrote
(Stopped.written), which are complete.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_deferring = 0
_pending: Optional[int] = None


class Stopped(BaseException):
    """A stop signal arrived (a BaseException, as KeyboardInterrupt: `except Exception` lets it pass)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.written: list[str] = []  # the prefixes moved into place before the stop (preprocess.py)

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process a signal ended: 128 + the signal's number."""
        return 128 + self.signum


def _not_ignored(signals) -> tuple[int, ...]:
    """Those not SIG_IGN now: `nohup` ignores SIGHUP so that a closed terminal lets the work finish."""
    return tuple(signum for signum in signals if signal.getsignal(signum) is not signal.SIG_IGN)


def _handler(signum: int, frame) -> None:
    global _pending
    if _deferring:
        _pending = signum
        return
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, STOP_SIGNALS raise Stopped; the previous handlers come back after it."""
    global _pending
    previous = {signum: signal.signal(signum, _handler) for signum in _not_ignored(STOP_SIGNALS)}
    _pending = None
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """A stop signal that arrives within the block is raised when the block ends (a no-op outside
    stop_on_signals: the handlers are then not ours)."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    except BaseException:  # the block's own error ends the tool: it is what the user must read
        _deferring -= 1
        raise
    _deferring -= 1
    if not _deferring and _pending is not None:
        signum, _pending = _pending, None
        raise Stopped(signum)


@contextlib.contextmanager
def stops_held_while_spawning() -> Iterator[None]:
    """Within the block, STOP_SIGNALS are blocked in this thread and a stop is raised as the block
    ends (signals_deferred: another thread, tqdm's monitor, may take the signal, and Python runs
    the handler in this one, in the middle of a worker's start-up: the worker then read a broken
    pipe, or outlived the pool, and printed a traceback). A worker spawned within the block starts
    with them blocked, since a child inherits the mask through fork and exec: Ctrl-C to the process
    group while a worker is still importing Python (before ignore_stop_in_worker runs) printed its
    KeyboardInterrupt traceback."""
    with signals_deferred():
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_in_worker() -> None:
    """A tokenizer worker leaves Ctrl-C to the parent (the terminal sends it to the whole process
    group): the parent terminates the pool, and no worker prints a KeyboardInterrupt traceback.
    The worker started with the stop signals blocked (stops_held_while_spawning): a Ctrl-C that came
    during its start-up is dropped as SIGINT becomes ignored, and SIGTERM and SIGHUP act again."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
