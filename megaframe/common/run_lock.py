"""A run directory has one owner.

Two megaframe-train processes on one run dir both resumed from the same checkpoint, rewrote the same
`global_stepN` directories and `latest`, and appended duplicate steps to metrics.jsonl. The owner
holds a POSIX record lock on RUN_DIR/.megaframe.lock for as long as it lives: the kernel releases
it when the holder dies (even by SIGKILL), so a crashed run never leaves a stale lock behind, and
POSIX locks (unlike flock) are seen across hosts on NFS and Lustre mounts that honour them.

Who holds it: the process that owns the job on this host. A self-launching megaframe-train (or the
Ray driver) takes it before its ranks start and tells them through MEGAFRAME_RUN_DIR_LOCK; under
torchrun or srun, rank 0 takes it and every rank learns the answer from one broadcast.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from megaframe.common import json_text
from megaframe.common.safe_files import UnsafeFile, open_regular, quote

LOCK_NAME = ".megaframe.lock"
HELD_BY_PARENT = "MEGAFRAME_RUN_DIR_LOCK"  # the resolved run dir our launcher has locked for us

_held: dict[Path, int] = {}  # run dir -> open descriptor: a POSIX lock lives as long as its process keeps it


class RunDirBusy(Exception):
    """Another live process owns the run dir."""


def _holder_text(fd: int) -> str:
    """Who holds the lock, from what the holder wrote into the file ('' when unreadable)."""
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        holder = json_text.loads(raw)
        return f" by pid {int(holder['pid'])} on {quote(holder['host'])} since {quote(holder['since'])}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def held_by_parent(run_dir: Path) -> bool:
    """Whether the process that launched us holds the lock on this run dir for us."""
    held = os.environ.get(HELD_BY_PARENT)
    return held is not None and Path(held) == Path(run_dir).resolve()


def inside_a_run(run_dir: Path) -> Optional[str]:
    """Why `run_dir` cannot hold a run: it lies in another run's checkpoints/ (a folder holding
    LOCK_NAME is a run's directory), whose saves replace and prune what is there (global_stepN,
    tmp-*): a run directory put there vanished with its checkpoints at that run's next save, unsaid.
    Read as given (absolute) and with its links resolved; elsewhere under a run's folder is fine.
    A checkpoints/ linked to shared storage is known at its target by the `latest` its saves write
    (there, only what its saves prune is refused: a global_stepN or tmp-* and what lies below)."""
    for path in dict.fromkeys((Path(os.path.abspath(run_dir)), Path(run_dir).resolve())):
        for folder in (path, *path.parents):
            if folder.name == "checkpoints" and os.path.lexists(folder.parent / LOCK_NAME):
                return (f"run dir {run_dir} is inside {folder}, the checkpoints of the run in {folder.parent}, "
                        f"whose saves replace and prune what lies there; choose a run dir outside it "
                        f"(hydra.run.dir=...)")
            if _PRUNED.fullmatch(folder.name) and _megaframes_checkpoints(folder.parent):
                return (f"run dir {run_dir} is inside {folder}, a checkpoint of a run's checkpoints "
                        f"({folder.parent}), whose saves replace and prune it; choose a run dir outside it "
                        f"(hydra.run.dir=...)")
    return None


_PRUNED = re.compile(r"global_step\d+|tmp-.+")  # what a run's saves replace, prune and trash (checkpoint/store.py)


def _megaframes_checkpoints(folder: Path) -> bool:
    """Whether `folder` is megaframe's checkpoints/ (reached through a link to shared storage too):
    its `latest` names a global_stepN that holds megaframe's manifest.json. DeepSpeed's own save
    folder also has a `latest`, but no manifest, and nothing there prunes (review)."""
    latest = folder / "latest"
    try:
        if not latest.is_file():  # a folder, a FIFO (whose open would wait) or nothing there: not one
            return False
        with open(latest, "rb") as pointer:
            named = re.fullmatch(rb"(global_step\d+)\s*", pointer.read(64))
        return named is not None and (folder / named[1].decode() / "manifest.json").is_file()
    except OSError:
        return False


def acquire(run_dir: Path) -> Optional[str]:
    """Lock run_dir for this process (creating it); None on success (or when already held here),
    else the one-line reason. The lock file is never deleted: unlinking a locked file would let a
    third process lock a new inode while the second still holds the old one."""
    if problem := inside_a_run(run_dir):
        return problem
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    try:  # a link planted as the lock is not followed: truncating it would overwrite its target
        fd = open_regular(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except UnsafeFile as err:
        return (f"{err.strerror}: megaframe-train will not lock or write through it; remove it "
                f"(rm {run_dir / LOCK_NAME}) and check who put it there, or choose another run dir (hydra.run.dir=...)")
    except OSError as err:
        return (f"run dir {run_dir}: cannot create {LOCK_NAME} ({err.strerror or err}); fix its permissions or "
                f"choose another run dir (hydra.run.dir=...)")
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in _HELD_ELSEWHERE:  # the file system keeps no locks: waiting would never help
            print(_no_locks_warning(run_dir, err), file=sys.stderr, flush=True)
        else:
            holder = _holder_text(fd)
            os.close(fd)
            return (f"run dir {run_dir} is in use{holder}: another megaframe-train is training there; "
                    f"wait for it to end, or choose another run dir (hydra.run.dir=...)")
    if planted := planted_link(run_dir):
        os.close(fd)
        return planted
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    _held[run_dir] = fd
    return None


# what megaframe-train appends to or reads back in a run dir by name: a symbolic link there (where
# megaframe makes none) would send its appends and reads to the link's target (files it only
# replaces by rename, config.yaml, are safe: the rename replaces a link, never follows it)
_WRITTEN_BY_NAME = ("metrics.jsonl", "logs", "checkpoints/latest", "wandb_run_id")


def planted_link(run_dir: Path) -> Optional[str]:
    """The one-line refusal when a file megaframe writes in run_dir by name is a symbolic link
    (checkpoints/ itself may be one: storage the user mounted elsewhere), else None."""
    logs = Path(run_dir) / "logs"
    candidates = [Path(run_dir) / name for name in _WRITTEN_BY_NAME]
    if logs.is_dir() and not logs.is_symlink():
        candidates += sorted(logs.glob("rank*.log"))
    for path in candidates:
        if path.is_symlink():
            return (f"run dir {run_dir}: {path.relative_to(run_dir)} is a symbolic link, which megaframe never makes "
                    f"there; megaframe-train will not write through it: remove it (rm {path}) and check who put it "
                    f"there, or choose another run dir (hydra.run.dir=...)")
    return None


# what lockf's F_SETLK answers when another process holds the lock; anything else (ENOLCK on NFS
# mounted nolock, EOPNOTSUPP or ENOSYS on Lustre without flock) says the file system keeps none
_HELD_ELSEWHERE = (errno.EAGAIN, errno.EACCES)


def _no_locks_warning(run_dir: Path, err: OSError) -> str:
    return (f"megaframe-train: warning: run dir {run_dir}: its file system takes no POSIX locks "
            f"({errno.errorcode.get(err.errno, err.errno)}: {err.strerror}), so nothing stops a second "
            f"megaframe-train from training in it at the same time; mount it with locks (NFS: without nolock; "
            f"Lustre: -o flock or localflock) or keep to one run per run dir")


def lock_for_children(run_dir: Path) -> Optional[str]:
    """Take the lock in a launching process and pass it to the ranks it starts (None on success)."""
    problem = acquire(run_dir)
    if problem is None:
        os.environ[HELD_BY_PARENT] = str(Path(run_dir).resolve())
    return problem


def release(run_dir: Path) -> None:
    """Give the lock back (the kernel does it anyway when the process ends)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)
