"""The run-dir lock (megaframe/common/run_lock.py): one owner at a time, released by the kernel when the
owner dies, however it dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from megaframe.common import run_lock

_HOLD = textwrap.dedent("""
    import sys, time
    from megaframe.common import run_lock
    assert run_lock.acquire(sys.argv[1]) is None
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(run_dir) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_owner_is_refused_naming_the_holder_and_the_fix(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        problem = run_lock.acquire(tmp_path / "run")
        assert problem is not None
        assert f"pid {holder.pid}" in problem and "hydra.run.dir" in problem and "\n" not in problem
    finally:
        holder.kill()
        holder.wait()


def test_a_run_dir_inside_another_runs_checkpoints_is_refused_before_it_is_made(tmp_path):
    """hydra.run.dir=R1/checkpoints/global_step2 was accepted: R1's next save pruned it, the nested run's
    checkpoints with it, unsaid (hostile review). Running or finished, R1 is another run's directory;
    elsewhere below it (R1/finetune) is the user's to use (review)."""
    holder = _holder(tmp_path / "R1")
    try:
        (tmp_path / "R1" / "checkpoints" / "global_step2").mkdir(parents=True)
        nested = tmp_path / "R1" / "checkpoints" / "global_step2" / "run"
        problem = run_lock.acquire(nested)
        assert problem == (f"run dir {nested} is inside {tmp_path / 'R1' / 'checkpoints'}, the checkpoints of the "
                           f"run in {tmp_path / 'R1'}, whose saves replace and prune what lies there; choose a run "
                           f"dir outside it (hydra.run.dir=...)")
        assert not nested.exists()
        assert run_lock.acquire(tmp_path / "R1" / "checkpoints") is not None
    finally:
        holder.kill()
        holder.wait()
    assert run_lock.acquire(tmp_path / "R1" / "checkpoints" / "x") is not None  # its lock file stays once it ended
    (tmp_path / "link").symlink_to(tmp_path / "R1" / "checkpoints")
    assert run_lock.acquire(tmp_path / "link" / "x") is not None  # resolved, too
    for fine in (tmp_path / "R1" / "finetune", tmp_path / "R2"):  # below the run, not in its checkpoints; beside
        assert run_lock.acquire(fine) is None
        run_lock.release(fine)


def test_a_run_dir_inside_a_runs_checkpoints_on_shared_storage_is_refused(tmp_path):
    """R1/checkpoints a link to shared storage: a run dir given at the link's target was accepted, and
    R1's saves pruned it (review). Its saves' `latest`, naming a checkpoint with megaframe's manifest,
    marks the target, and only what they prune (global_stepN, tmp-*) is refused there. DeepSpeed's
    own save folder (a `latest`, no manifest), a `latest` naming no checkpoint, or a FIFO of that
    name (whose open would wait) mark nothing (review)."""
    shared = tmp_path / "scratch" / "r1-checkpoints"
    (shared / "global_step2").mkdir(parents=True)
    holder = _holder(tmp_path / "R1")
    holder.kill()
    holder.wait()
    (tmp_path / "R1" / "checkpoints").symlink_to(shared)
    (shared / "latest").write_text("global_step2")
    nested = shared / "global_step2" / "run"
    assert run_lock.acquire(nested) is None  # DeepSpeed's layout: no manifest.json, nothing megaframe prunes
    run_lock.release(nested)
    (shared / "global_step2" / "manifest.json").write_text("{}")
    for inside in (shared / "global_step2" / "again", shared / "tmp-global_step4" / "x"):
        problem = run_lock.acquire(inside)
        pruned = inside.parent
        assert problem == (f"run dir {inside} is inside {pruned}, a checkpoint of a run's checkpoints ({shared}), "
                           f"whose saves replace and prune it; choose a run dir outside it (hydra.run.dir=...)")
        assert not inside.exists()
    assert run_lock.acquire(shared / "beside") is None  # in the folder, but nothing its saves touch
    run_lock.release(shared / "beside")
    (tmp_path / "notes" / "global_step1").mkdir(parents=True)
    (tmp_path / "notes" / "latest").write_text("my newest notes\n")
    (tmp_path / "pipes" / "global_step1").mkdir(parents=True)
    os.mkfifo(tmp_path / "pipes" / "latest")
    for fine in (tmp_path / "notes" / "global_step1" / "run", tmp_path / "pipes" / "global_step1" / "run"):
        assert run_lock.acquire(fine) is None
        run_lock.release(fine)


def test_the_lock_is_free_again_once_its_holder_is_killed(tmp_path):
    holder = _holder(tmp_path / "run")
    os.kill(holder.pid, signal.SIGKILL)  # the OOM killer's way: no cleanup code runs
    holder.wait()
    try:
        assert run_lock.acquire(tmp_path / "run") is None
        # held here now: a repeat in the same process is not a second owner
        assert run_lock.acquire(tmp_path / "run") is None
    finally:
        run_lock.release(tmp_path / "run")


def test_a_released_lock_can_be_taken_by_another_process(tmp_path):
    assert run_lock.acquire(tmp_path / "run") is None
    run_lock.release(tmp_path / "run")
    holder = _holder(tmp_path / "run")  # would fail its assert if the lock were still held here
    holder.kill()
    holder.wait()


def test_ranks_started_by_the_owner_know_it_holds_the_lock_for_them(tmp_path, monkeypatch):
    monkeypatch.delenv(run_lock.HELD_BY_PARENT, raising=False)
    assert not run_lock.held_by_parent(tmp_path / "run")
    try:
        assert run_lock.lock_for_children(tmp_path / "run") is None
        assert run_lock.held_by_parent(tmp_path / "run" / ".." / "run")
        assert not run_lock.held_by_parent(tmp_path / "other")
    finally:
        run_lock.release(tmp_path / "run")
        os.environ.pop(run_lock.HELD_BY_PARENT, None)


def test_a_file_system_without_locks_trains_with_one_warning_not_a_refusal_forever(tmp_path, monkeypatch, capsys):
    """NFS mounted nolock answers ENOLCK, Lustre without flock EOPNOTSUPP or ENOSYS: every run was
    refused as "in use" (naming a dead pid after the first), and waiting never helps. Now the run
    goes on, with one line saying what is not protected and how to mount for it; a lock held
    elsewhere (EAGAIN, EACCES) is still a refusal."""
    import errno
    import fcntl

    for code in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        def refuse(fd, how, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(fcntl, "lockf", refuse)
        run_dir = tmp_path / f"run{code}"
        try:
            assert run_lock.acquire(run_dir) is None
        finally:
            run_lock.release(run_dir)
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "warning" in line and errno.errorcode[code] in line and "nolock" in line, line
    monkeypatch.setattr(fcntl, "lockf", lambda fd, how: (_ for _ in ()).throw(OSError(errno.EAGAIN, "busy")))
    assert "is in use" in run_lock.acquire(tmp_path / "run-busy")
