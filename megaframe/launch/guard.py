"""A rank dies with the process that launched it.

torchrun's workers (and megaframe-train's self-launched ranks, whose agent runs inside the
megaframe-train process) run in sessions of their own: when the launcher is killed outright (the
OOM killer, `kill -9`, `timeout -k`), nothing tells them, and they went on training and writing
checkpoints under PID 1 after the command had exited 137. Linux's parent-death signal ends each
rank with its launcher instead.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID = "MEGAFRAME_LAUNCHER_PID"  # set by the self-launching megaframe-train for its ranks
_PR_SET_PDEATHSIG = 1
_parent_at_start: int | None = None  # this process's parent as its entry point began (remember_parent)


def remember_parent() -> None:
    """The first line of the entry point, before its imports: note the parent. Under an external
    torchrun nothing names the launcher, and a torchrun killed during the rank's imports (seconds:
    torch, DeepSpeed) left the rank orphaned before die_with_launcher could tell; now only a kill
    during the interpreter's own start (tens of ms) does. A parent that is PID 1 (torchrun as a
    container's init) is remembered as such, so it is no sign of an orphan."""
    global _parent_at_start
    _parent_at_start = os.getppid()


def launched_by_an_agent() -> bool:
    """Under torchrun's elastic agent (standalone or megaframe-train's own): the parent is the agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or LAUNCHER_PID in os.environ


def die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits; exit at once if the launcher
    that megaframe-train recorded, or the parent remember_parent noted, is already gone (it died
    before this line ran). Linux only: on other systems torchrun's own signal forwarding is all
    there is."""
    if not sys.platform.startswith("linux") or not launched_by_an_agent():
        return
    expected = os.environ.get(LAUNCHER_PID)
    die_with_parent(int(expected) if expected is not None else _parent_at_start)


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent exits (Linux; nothing elsewhere); exit at once if the
    parent is not `parent` any more (it died before this line ran). Also the sweep launcher's
    preexec_fn for its points."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(128 + int(signal.SIGKILL))  # orphaned already: the launcher is not our parent any more
