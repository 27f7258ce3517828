"""Ctrl-C in a tool that has no stop handling of its own at that moment (its imports, a planner's
search, an evaluation): one line and exit 130, as megaframe-train and megaframe-sample end, not the
traceback of wherever the KeyboardInterrupt landed (torch's import machinery printed 50 lines).

And once the tool is done: a Ctrl-C during the interpreter's shutdown is ignored. It landed in
torch's atexit and weakref finalizers, printing "KeyboardInterrupt" tracebacks under an output that
was complete and reported, or, once Python had reset its handlers, killed the process silently
(exit 130 for a finished job). SIGTERM and SIGHUP keep their default action, which ends the process
without a traceback: an exit callback that hangs (a large NVMe swap folder's removal, wandb's
teardown) can still be ended by them, by torchrun's agent or a scheduler."""
from __future__ import annotations

import atexit
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator  # not typing: 2.5 ms more before the guard is up


@contextlib.contextmanager
def interrupted_in_one_line(prog: str) -> Iterator[None]:
    """Within the block, a KeyboardInterrupt ends the process with `PROG: interrupted` and exit 130
    (128 + SIGINT, docs/failures.md). However the block ends, the shutdown after it is not stopped."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        shutdown_not_stopped()


def shutdown_not_stopped() -> None:
    """Ignore Ctrl-C from the start of the interpreter's shutdown on. atexit runs its callbacks
    last registered first, so this one, registered once the tool's work is done (after every import
    registered its own), runs before torch's. Python resets a handler of its own to the default at
    the end of its shutdown, but leaves an ignored signal ignored. In a process that goes on (a test
    calling a tool's main), nothing changes until that process exits."""
    atexit.unregister(ignore_ctrl_c)  # registered again: last, whatever was registered since
    atexit.register(ignore_ctrl_c)


def ignore_ctrl_c() -> None:
    """For a process that is exiting (only the main thread may set handlers; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
