"""The hidden temp files a dataset (or an epoch order, epoch_orders.py) is written to before it
moves into place, named after their writer (`.NAME.SUFFIX.HOST-PID.XXXXXXXX.tmp`), so that those a
SIGKILLed writer left behind (as large as its output; no handler runs on SIGKILL) are found and
removed by the next writer of the same name. Only files of this host whose writing process is gone
are removed: a live writer's, or one on another node of a shared file system, is never touched."""
from __future__ import annotations

import os
import re
import socket
import tempfile
from pathlib import Path

_SUFFIXES = ("bin", "idx", "json")


def host_tag() -> str:
    """This host's name as temp names carry it (dots would split the name's fields)."""
    return socket.gethostname().replace(".", "_") or "host"


def open_temp(directory: Path, name: str, suffix: str) -> tuple[int, Path]:
    """mkstemp beside the dataset (an os.replace into place is then a rename), named after its writer."""
    fd, path = tempfile.mkstemp(dir=directory, prefix=f".{name}.{suffix}.{host_tag()}-{os.getpid()}.", suffix=".tmp")
    return fd, Path(path)


def process_gone(pid: int) -> bool:
    """Whether no process of this host has this pid (a writer that was killed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def dead_writers(directory: Path, pattern: re.Pattern) -> list[os.DirEntry]:
    """The entries of `directory` whose name matches `pattern` (with groups `host` and `pid`) and was
    given by a writer on this host whose process is gone: never a live writer's, nor another host's
    on a shared file system."""
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no such folder (yet), or not one
        return []
    dead = []
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        pid = int(found["pid"]) if found else 0
        if found and found["host"] == host_tag() and pid != os.getpid() and process_gone(pid):
            dead.append(entry)
    return dead


def remove_orphans(prefix: Path, suffixes: tuple[str, ...] = _SUFFIXES) -> list[Path]:
    """Remove the temp files that a writer of `prefix` on this host left when it was killed; return them."""
    pattern = re.compile(rf"\.{re.escape(prefix.name)}\.(?:{'|'.join(suffixes)})\.(?P<host>.+)-(?P<pid>\d+)\.[^.]+\.tmp")
    removed = []
    for entry in dead_writers(prefix.parent, pattern):
        if entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
    return removed
