"""A launcher that ran torch's elastic agent ends with the job's code, not an abort at its exit
(megaframe/common/process_exit.py). CI saw `megaframe-train parallel.dp=2` stopped by SIGTERM end by
SIGABRT ("terminate called without an active exception") after a clean, saved stop: the agent's
rendezvous keep-alive thread was inside a c10d store call as the interpreter finalized. Here a daemon
thread that calls the store without pause makes that moment certain, each in a new interpreter (the
tests' warm zygote does not finalize as an interpreter does)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.helpers import REPO, TINY, cli_env

# a daemon thread that is always in or entering a store call with the GIL released, as the agent's
# keep-alive is once every 5 s
SPINNING_STORE = """
import threading
import torch.distributed as dist

def spin_on_a_store():
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    while True:
        store.add("beats", 1)

threading.Thread(target=spin_on_a_store, daemon=True).start()
import time
time.sleep(0.3)
"""

EXIT_HANDLERS = """
import atexit, pathlib, sys, threading, time
out = pathlib.Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def finish_late():
    time.sleep(0.5)
    (out / "thread").write_text("finished")
threading.Thread(target=finish_late).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(2)  # kept and never shut down: its idle worker waits for work
pool.submit(lambda: None).result()
print("printed before the exit", end="")
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 parks a late daemon thread instead of ending it")
def test_sys_exit_with_a_daemon_thread_in_a_store_call_aborts():
    """The premise, so the tests below can fail: the interpreter's own exit aborts here."""
    ended = _python(SPINNING_STORE + "import sys\nsys.exit(143)\n")
    assert ended.returncode == -6 and "terminate called without an active exception" in ended.stderr, ended


def test_the_exit_past_daemon_threads_keeps_the_code_the_handlers_and_the_output(tmp_path):
    code = (SPINNING_STORE + EXIT_HANDLERS
            + "from megaframe.common.process_exit import exit_past_daemon_threads\nexit_past_daemon_threads(143)\n")
    ended = _python(code, str(tmp_path))
    assert ended.returncode == 143 and ended.stderr == "", ended
    assert ended.stdout == "printed before the exit"  # the buffered stream flushed (stdout is a pipe)
    # atexit handlers ran, after the non-daemon thread; the executor's idle worker was told to stop
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "finished"


def test_megaframe_train_ends_with_the_agents_code_past_its_daemon_threads(tmp_path):
    """The launcher's own path (launch/main.py after local.self_launch): the agent stand-in leaves the
    spinning thread behind and returns 143, as torch's agent does after a SIGTERM the ranks saved on."""
    code = SPINNING_STORE.replace("time.sleep(0.3)", "") + f"""
import megaframe.launch.local as local
def agent_stopped_by_sigterm(overrides, world, run_dir):
    time.sleep(0.3)
    return 143
local.self_launch = agent_stopped_by_sigterm
from megaframe.launch.main import train_main
train_main({[*TINY, "parallel.dp=2", "zero=stage1", f"hydra.run.dir={tmp_path / 'run'}"]!r})
"""
    ended = _python(code)
    assert ended.returncode == 143, ended.stderr[-3000:]
    assert "terminate called" not in ended.stderr and "Traceback" not in ended.stderr, ended.stderr[-3000:]
