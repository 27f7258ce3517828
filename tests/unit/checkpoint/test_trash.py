"""The checkpoints' trash (checkpoint/store.py TrashCollector): rank 0 deletes pruned checkpoints on
a thread of its own (tests/dist/test_checkpoint_trash.py: no rank waits on it), by an rm child
process (no per-file work on the interpreter, none left running after the rank's exit). What must
still hold: an error does not end the deleting for the rest of the run, the storage never holds more than
keep + 1 checkpoints however slow the delete, a resume deletes what a crash left, and a rename the
file system refuses deletes in place rather than raising on rank 0 alone."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megaframe.checkpoint import store, universal


def _trash(save_dir: Path, name: str = "global_step1") -> Path:
    junk = save_dir / f"{store.TRASH_PREFIX}{name}"
    junk.mkdir(parents=True)
    (junk / "model.safetensors").write_bytes(b"\0" * 64)
    return junk


def test_an_error_in_the_delete_is_one_line_and_the_next_collect_deletes(tmp_path, monkeypatch, capsys):
    """A stale NFS handle in one pass: the thread used to die with it, and every later collect only
    noted its directory for a thread that was gone, so no pruned checkpoint was deleted again."""
    junk = _trash(tmp_path)
    real, calls = store.empty_trash, []

    def failing_once(directory):
        calls.append(directory)
        if len(calls) == 1:
            raise OSError(116, "Stale file handle")
        real(directory)
    monkeypatch.setattr(store, "empty_trash", failing_once)
    trash = store.TrashCollector()
    trash.collect(tmp_path)
    trash.wait()
    assert junk.exists()
    warning = capsys.readouterr().err
    assert "could not empty the checkpoints' trash" in warning and "Stale file handle" in warning
    assert warning.count("\n") == 1
    trash.collect(tmp_path)
    trash.wait()
    assert not junk.exists() and len(calls) == 2


def test_a_save_waits_for_a_delete_still_running_so_at_most_keep_plus_one_are_stored(tmp_path, monkeypatch):
    save_dir = tmp_path / "checkpoints"
    let_go, deleting = threading.Event(), threading.Event()
    real = store.empty_trash

    def slow(directory):
        if list(Path(directory).glob(store.TRASH_PREFIX + "*")):
            deleting.set()
            assert let_go.wait(30)
        real(directory)
    monkeypatch.setattr(store, "empty_trash", slow)
    trash = store.TrashCollector()
    store.save(None, save_dir, 1, {"step": 1}, native=False, keep=1, trash=trash)
    store.save(None, save_dir, 2, {"step": 2}, native=False, keep=1, trash=trash)  # step 1 to the trash
    assert deleting.wait(30)
    third = threading.Thread(target=store.save, args=(None, save_dir, 3, {"step": 3}),
                             kwargs=dict(native=False, keep=1, trash=trash))
    third.start()
    time.sleep(0.5)
    stored = sorted(p.name for p in save_dir.iterdir() if p.name.startswith(("global_step", "tmp-")))
    assert stored == ["global_step2", f"{store.TRASH_PREFIX}global_step1"], stored  # step 3 not begun
    let_go.set()
    third.join(30)
    trash.wait()
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step3", "latest"]


def test_a_resume_deletes_what_a_crash_left_in_the_trash(tmp_path, monkeypatch):
    from megaframe.checkpoint import manager as manager_module
    from megaframe.checkpoint.manager import CheckpointManager

    class _Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise _Stop
    junk = _trash(tmp_path / "checkpoints")
    manager = CheckpointManager.__new__(CheckpointManager)  # only what resume() reads before the start-over
    manager.fast, manager.is_logger, manager.trash = None, True, store.TrashCollector()
    manager.run_dir, manager.dir = tmp_path, tmp_path / "checkpoints"
    manager.metrics, manager.cfg = None, SimpleNamespace(train=SimpleNamespace(resume="none"))
    monkeypatch.setattr(manager_module.resume_checks, "start_over", stop)
    with pytest.raises(_Stop):
        manager.resume()
    manager.trash.wait()
    assert not junk.exists()


@pytest.mark.parametrize("resume", ["auto", "none", "PATH"])
def test_a_resume_deletes_the_saves_a_kill_cut_short(tmp_path, monkeypatch, capsys, resume):
    """A stop's save killed by the scheduler at step 4321 left tmp-global_step4321, which only a later
    save of step 4321 would have set aside: a whole checkpoint's bytes each preemption, for good.
    A directory named to resume from is kept."""
    from megaframe.checkpoint import manager as manager_module
    from megaframe.checkpoint.manager import CheckpointManager

    class _Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise _Stop
    save_dir = tmp_path / "checkpoints"
    cut_short = save_dir / "tmp-global_step4321"
    cut_short.mkdir(parents=True)
    (cut_short / "rank0.safetensors").write_bytes(b"\0" * 64)
    named = save_dir / "tmp-global_step12"
    named.mkdir()
    alone = tmp_path / "alone"  # unfinished saves alone: resume_checks says so (lost storage?); left for it
    (alone / "tmp-global_step5").mkdir(parents=True)
    assert store.trash_unfinished_saves(alone) == [] and (alone / "tmp-global_step5").is_dir()
    (save_dir / "global_step4000").mkdir()
    (save_dir / "tmp-old-global_step8").mkdir()  # an interrupted swap: its new copy is finish_interrupted_swaps'
    (save_dir / "tmp-global_step8").mkdir()
    resume = str(named) if resume == "PATH" else resume
    manager = CheckpointManager.__new__(CheckpointManager)  # only what resume() reads before the resume itself
    manager.fast, manager.is_logger, manager.trash = None, True, store.TrashCollector()
    manager.run_dir, manager.dir = tmp_path, save_dir
    manager.metrics, manager.cfg = None, SimpleNamespace(train=SimpleNamespace(resume=resume))
    monkeypatch.setattr(manager_module.resume_checks, "start_over", stop)
    monkeypatch.setattr(manager_module.store, "newest_verified", stop)
    monkeypatch.setattr(manager_module.store, "resolve_resume", stop)
    with pytest.raises(_Stop):
        manager.resume()
    manager.trash.wait()
    assert not cut_short.exists() and not list(save_dir.glob(store.TRASH_PREFIX + "*"))
    # auto put the swap right (the old copy back); the others leave both copies for the next auto
    assert (save_dir / "tmp-global_step8").is_dir() == (resume != "auto") == (save_dir / "tmp-old-global_step8").is_dir()
    assert (save_dir / "global_step8").is_dir() == (resume == "auto")
    assert named.exists() == (resume == str(named))
    said = capsys.readouterr().err
    assert "tmp-global_step4321" in said and "left by a save that did not finish" in said, said


def test_a_rename_the_file_system_refuses_deletes_in_place(tmp_path, monkeypatch):
    """to_trash runs on rank 0 before a barrier: an OSError there left the other ranks waiting."""
    doomed = tmp_path / "tmp-global_step5"
    doomed.mkdir()
    (doomed / "part").write_text("x")

    def refused(*args):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(universal.os, "replace", refused)
    universal.to_trash(doomed)
    assert list(tmp_path.iterdir()) == []


def test_a_delete_slower_than_the_bound_is_one_line_and_the_save_goes_on(tmp_path, monkeypatch, capsys):
    """The other ranks wait at the save's barrier while rank 0 waits for the delete: the wait is
    bounded (a checkpoint a crash left, deleted as the next run resumes, may take longer than the
    collective timeout), and a stop's save does not wait at all (trash_wait_s=0)."""
    save_dir = tmp_path / "checkpoints"
    let_go = threading.Event()
    real = store.empty_trash

    def stuck(directory):
        if list(Path(directory).glob(store.TRASH_PREFIX + "*")):
            assert let_go.wait(30)
        real(directory)
    monkeypatch.setattr(store, "empty_trash", stuck)
    trash = store.TrashCollector()
    try:
        for step in (1, 2):
            store.save(None, save_dir, step, {"step": step}, native=False, keep=1, trash=trash)
        capsys.readouterr()
        store.save(None, save_dir, 3, {"step": 3}, native=False, keep=1, trash=trash, trash_wait_s=0.3)
        warning = capsys.readouterr().err
        assert "has taken over 0.3 s; saving step 3 beside them" in warning and warning.count("\n") == 1
        store.save(None, save_dir, 4, {"step": 4}, native=False, keep=1, trash=trash, trash_wait_s=0.0)
        assert capsys.readouterr().err == ""
        assert (save_dir / "global_step4").is_dir() and (save_dir / f"{store.TRASH_PREFIX}global_step1").is_dir()
    finally:
        let_go.set()
    trash.wait()
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step4", "latest"]


def test_the_delete_does_no_per_file_work_in_this_interpreter(tmp_path, monkeypatch):
    """A thread's shutil.rmtree holds the GIL between its unlink calls: a step loop of small
    operations ran 2-3x slower while one deleted 100,000 files (BENCHMARKS.md)."""
    junk = _trash(tmp_path)
    for i in range(50):
        (junk / f"shard{i}").write_bytes(b"x")
    calls = []
    for name in ("unlink", "rmdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    store.empty_trash(tmp_path)
    assert not junk.exists() and calls == []


_EXIT_WHILE_DELETING = """
import os, sys, time
from pathlib import Path
from megaframe.checkpoint import store
save_dir = Path(sys.argv[1])
(save_dir / (store.TRASH_PREFIX + "global_step1")).mkdir(parents=True)
store.TrashCollector().collect(save_dir)
deadline = time.monotonic() + 20
while not (save_dir / "rm.pid").exists():
    if time.monotonic() > deadline:
        sys.exit("no rm child started")
    time.sleep(0.05)
how = sys.argv[2]
if how == "exit":
    sys.exit(1)  # a failed run's exit: the trash thread is a daemon
if how == "os._exit":
    os._exit(1)  # the stop watchdog's exit: no atexit
os.kill(os.getpid(), 9)  # SIGKILL: the OOM killer, a scheduler's hard stop
"""


@pytest.mark.parametrize("how, code", [("exit", 1), ("os._exit", 1), ("SIGKILL", -9)])
def test_a_run_that_exits_while_deleting_leaves_no_rm_behind(tmp_path, how, code):
    """The rm child of a failed, stopped or killed rank ends with it (what it left keeps its
    tmp-del- name for the next resume), not left running as an orphan."""
    if how != "exit" and store._setpriv() is None:
        pytest.skip("needs util-linux's setpriv (the parent-death signal); without it rm finishes deleting")
    slow_rm = tmp_path / "bin" / "rm"
    slow_rm.parent.mkdir()
    slow_rm.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/rm.pid\nexec sleep 60\n")
    slow_rm.chmod(0o755)
    env = {**os.environ, "PATH": f"{slow_rm.parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_DELETING, str(tmp_path), how], env=env, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == code, done.stderr
    pid = int((tmp_path / "rm.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"rm (pid {pid}) outlived the rank that started it"
    assert (tmp_path / f"{store.TRASH_PREFIX}global_step1").exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
