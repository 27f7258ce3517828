"""JIT build locks are judged by their owner being alive, never by age: a baton whose builder is gone
is removed with a warning however fresh; one whose builder runs is waited for however old; the
OS lock megaframe builds under is released by the kernel when its holder is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from megaframe.backends.deepspeed.build_locks import OWNER_LOCK, building_in, clear_stale_build_locks, owner_lock


def test_a_fresh_lock_whose_owner_is_gone_is_removed_with_a_warning(tmp_path):
    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir()
    lock.touch()  # seconds old: an age rule would have waited 10 minutes for it
    warnings = []
    assert clear_stale_build_locks(tmp_path, warn=warnings.append) == [lock]
    assert not lock.exists()
    assert len(warnings) == 1 and str(lock) in warnings[0] and "owner is gone" in warnings[0]


def test_an_old_lock_of_a_live_build_is_waited_for_and_left_to_its_owner(tmp_path):
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    day_ago = time.time() - 86400
    os.utime(lock, (day_ago, day_ago))
    # a "build" running in the op's folder (as ninja and the compiler do), releasing the baton when done
    builder = subprocess.Popen(["sh", "-c", "sleep 0.6; rm lock"], cwd=folder)
    try:
        time.sleep(0.1)
        assert building_in(folder)
        warnings = []
        start = time.monotonic()
        assert clear_stale_build_locks(tmp_path, poll_s=0.05, warn=warnings.append) == []
        assert time.monotonic() - start >= 0.3 and not warnings
    finally:
        builder.wait(timeout=10)
    assert not building_in(folder)


def test_no_locks_no_wait(tmp_path):
    (tmp_path / "shm_comm").mkdir()
    assert clear_stale_build_locks(tmp_path) == []


HOLD = """
import sys, time
from megaframe.backends.deepspeed.build_locks import owner_lock
with owner_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_the_owner_lock_waits_for_a_live_holder_and_is_free_once_it_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        killer = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -{signal.SIGKILL.value} {holder.pid}"])
        waits = []
        start = time.monotonic()
        with owner_lock(tmp_path, warn=waits.append):  # blocks until the kernel drops the dead holder's lock
            waited = time.monotonic() - start
        killer.wait(timeout=10)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert waited >= 0.4 and len(waits) == 1 and "waiting for another megaframe process" in waits[0]
    assert (tmp_path / OWNER_LOCK).exists()  # the file stays; only the kernel's lock matters
