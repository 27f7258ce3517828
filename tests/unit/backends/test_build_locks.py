"""JIT build locks are judged by their owner being alive, never by age: a baton whose owner is gone
is removed with a warning however fresh; one whose owner holds it open or whose compiler runs is
waited for however old; the OS lock megaframe builds under is released by the kernel when its
holder is killed."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megaframe.backends.deepspeed import build_locks
from megaframe.backends.deepspeed.build_locks import (OWNER_LOCK, RELEASE_GRACE_S, building_in,
                                                      clear_stale_build_locks, held_open, load_ops, owner_lock)
from megaframe.common.failures import ExitCode, MissingSystemPiece


def _fake_ninja(tmp_path) -> str:
    """A program whose process name is `ninja` (a copy of sleep): what a real build runs in the op's folder."""
    ninja = tmp_path / "bin" / "ninja"
    ninja.parent.mkdir(exist_ok=True)
    shutil.copy(shutil.which("sleep"), ninja)
    return str(ninja)


def test_a_fresh_lock_whose_owner_is_gone_is_removed_with_a_warning(tmp_path):
    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir()
    lock.touch()  # seconds old: an age rule would have waited 10 minutes for it
    warnings = []
    assert clear_stale_build_locks(tmp_path, warn=warnings.append) == [lock]
    assert not lock.exists()
    assert len(warnings) == 1 and str(lock) in warnings[0] and "owner is gone" in warnings[0]


# torch's own baton, as a JIT build holds it: Python steps, the compiler in the op's folder, Python
# steps again, then release (which closes the descriptor an instant before it removes the file)
# (torch/utils/file_baton.py loaded alone: importing torch would take the child seconds)
BUILD = """
import importlib.util, os, subprocess, sys, time
torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
spec = importlib.util.spec_from_file_location("file_baton", os.path.join(torch_dir, "utils", "file_baton.py"))
file_baton = importlib.util.module_from_spec(spec)
spec.loader.exec_module(file_baton)
folder, ninja, python_steps_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
baton = file_baton.FileBaton(os.path.join(folder, "lock"))
assert baton.try_acquire()
day_ago = time.time() - 86400
os.utime(os.path.join(folder, "lock"), (day_ago, day_ago))
print("acquired", flush=True)
time.sleep(python_steps_s)
subprocess.run([ninja, "0.3"], cwd=folder, check=True)
time.sleep(python_steps_s)
baton.release()
"""


def test_an_old_lock_of_a_live_build_is_waited_for_and_left_to_its_owner(tmp_path):
    """The owner is alive while it holds the baton open, compiler running or not. A shell that ran
    ninja then `rm lock` was judged dead between the two (CI, under load) and its baton removed."""
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    python_steps_s = 2 * RELEASE_GRACE_S  # longer than the grace: only the open descriptor shows the owner
    builder = subprocess.Popen([sys.executable, "-c", BUILD, str(folder), _fake_ninja(tmp_path), str(python_steps_s)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "acquired"
        assert held_open(folder / "lock") and not building_in(folder)  # its Python steps: no compiler yet
        warnings = []
        start = time.monotonic()
        assert clear_stale_build_locks(tmp_path, poll_s=0.05, warn=warnings.append) == []
        assert time.monotonic() - start >= 2 * python_steps_s and not warnings
    finally:
        _, errors = builder.communicate(timeout=30)
    assert builder.returncode == 0, errors  # its own release found the file it created
    assert not held_open(folder / "lock") and not (folder / "lock").exists()


def test_a_lock_that_goes_while_judged_ownerless_is_not_reported(tmp_path, monkeypatch):
    """A baton whose owner released it in the instant it was judged is gone within the grace: the
    file is not removed by us nor reported stale. (A longer grace here: a loaded host may take
    a while to start the shell that removes it.)"""
    monkeypatch.setattr(build_locks, "RELEASE_GRACE_S", 5.0)
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    (folder / "lock").touch()
    remover = subprocess.Popen(["sh", "-c", f"sleep 0.3; rm {folder / 'lock'}"])
    try:
        warnings = []
        assert clear_stale_build_locks(tmp_path, poll_s=0.02, warn=warnings.append) == [] and not warnings
    finally:
        remover.wait(timeout=10)
    assert remover.returncode == 0  # it, not us, removed the file


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


def test_a_shell_left_open_in_the_op_folder_is_not_a_build(tmp_path):
    """A shell whose working directory was cpu_adam/ made every run wait forever on a dead baton."""
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    (folder / "lock").touch()
    shell = subprocess.Popen(["sh", "-c", "sleep 30"], cwd=folder)
    try:
        time.sleep(0.1)
        assert not building_in(folder)
        assert clear_stale_build_locks(tmp_path, warn=lambda _: None) == [folder / "lock"]
    finally:
        shell.kill()
        shell.wait()


def test_a_build_that_outlasts_the_wait_ends_the_run_with_exit_6(tmp_path):
    folder = tmp_path / "async_io"
    folder.mkdir()
    (folder / "lock").touch()
    builder = subprocess.Popen([_fake_ninja(tmp_path), "30"], cwd=folder)
    try:
        time.sleep(0.1)
        with pytest.raises(MissingSystemPiece, match=r"waited \d+ s for the build of async_io") as caught:
            clear_stale_build_locks(tmp_path, poll_s=0.05, limit_s=0.3)
        assert caught.value.exit_code == ExitCode.MISSING_SYSTEM and "MEGAFRAME_BUILD_WAIT_S" in str(caught.value)
        assert (folder / "lock").exists()  # the live build's baton is left alone
    finally:
        builder.kill()
        builder.wait()


def test_the_owner_lock_wait_is_bounded_and_a_run_needing_no_op_takes_no_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(MissingSystemPiece, match="another megaframe process building DeepSpeed ops"):
            with owner_lock(tmp_path, warn=lambda _: None, limit_s=0.4, poll_s=0.05):
                pass
        assert 0.4 <= time.monotonic() - start < 5
        load_ops([], tmp_path)  # returns at once although the lock is held
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_ops_are_built_with_deepspeeds_flags_less_debug_information(tmp_path, monkeypatch):
    """-g made a cold async_io build half as long again (553 against 432 CPU-s on the 2-core host);
    every other flag DeepSpeed chose (-O3, -march=native, async_io's -O0) is kept."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    built = {}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # where the ops' one-unit sources go
    monkeypatch.setattr(OpBuilder, "load", lambda self, verbose=True: built.update({
        self.name: (type(self).cxx_args(self), self.cxx_args())}))
    load_ops(["CPUAdamBuilder", "AsyncIOBuilder"], tmp_path)
    for theirs, ours in (built["cpu_adam"], built["async_io"]):  # (async_io loads pin_memory, built without -g)
        assert "-g" in theirs and "-O3" in theirs
        assert ours == [flag for flag in theirs if flag != "-g"]


def test_py_cpuinfo_is_asked_once_per_process(monkeypatch):
    """Each get_cpu_info starts an interpreter (1.2 CPU-s); DeepSpeed asks 3-5 times per offload rank."""
    import cpuinfo

    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or {"arch": "X86_64", "flags": ["avx2"]})
    build_locks.answer_cpu_info_once()
    build_locks.answer_cpu_info_once()  # a second load_ops in the process keeps the one answer
    first = cpuinfo.get_cpu_info()
    first["flags"].append("mutated by a caller")
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]} and len(asked) == 1
