"""Ending a process that torch's elastic agent ran in, without an abort at the interpreter's exit.

The agent leaves daemon threads behind: the rendezvous keep-alive (every 5 s a c10d store call, the
GIL released) stays on after a signal stopped the job, since torch keeps the rendezvous open for the
other nodes. When `sys.exit` finalizes the interpreter while that thread is inside the store call,
CPython 3.11-3.13 ends the thread with pthread_exit as it takes the GIL back; the unwind runs through
pybind11's GIL guard, whose destructor cannot throw, and the C++ runtime aborts the process: "terminate
called without an active exception", exit -6 instead of 143 after a saved, clean stop (seen in CI).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from megaframe.common.ctrl_c import ignore_ctrl_c


def exit_past_daemon_threads(code: int) -> NoReturn:
    """Exit with `code` as sys.exit would, less the interpreter's finalization: threading's own
    shutdown first (what Py_FinalizeEx runs first: its exit hooks, which tell a ThreadPoolExecutor's
    idle workers to stop, then a join of every non-daemon thread, those started meanwhile too), the
    atexit handlers (logging's flush among them), the standard streams; then the process ends at once,
    with the daemon threads where they are. Objects' __del__ methods do not run."""
    try:
        if threading.current_thread() is threading.main_thread():
            threading._shutdown()  # private, but it is the interpreter's own first step of an exit
        else:  # _shutdown from another thread would wait for that thread itself
            for thread in threading.enumerate():
                if not thread.daemon and thread not in (threading.main_thread(), threading.current_thread()):
                    thread.join()
    except KeyboardInterrupt:  # Ctrl-C while a thread is joined: the job is over, end with its code
        pass
    ignore_ctrl_c()  # nor while torch's exit callbacks run (common/ctrl_c.py)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)
