"""A JIT build lock left by a killed process is removed with a warning; a live one is waited for."""
from __future__ import annotations

import os
import threading
import time

from megaframe.backends.deepspeed.build_locks import clear_stale_build_locks


def test_a_lock_older_than_the_limit_is_removed_with_a_warning(tmp_path):
    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir()
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    warnings = []
    assert clear_stale_build_locks(tmp_path, max_age_s=600, warn=warnings.append) == [lock]
    assert not lock.exists()
    assert len(warnings) == 1 and str(lock) in warnings[0] and "60 min" in warnings[0]


def test_a_live_lock_is_waited_for_and_left_to_its_owner(tmp_path):
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    releaser = threading.Timer(0.3, lock.unlink)
    releaser.start()
    start = time.monotonic()
    warnings = []
    assert clear_stale_build_locks(tmp_path, max_age_s=600, poll_s=0.05, warn=warnings.append) == []
    assert time.monotonic() - start >= 0.25 and not warnings
    releaser.join()


def test_no_locks_no_wait(tmp_path):
    (tmp_path / "shm_comm").mkdir()
    assert clear_stale_build_locks(tmp_path, max_age_s=600) == []
