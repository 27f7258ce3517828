"""Opening files in run and checkpoint directories without following links megaframe did not make.

A run dir on shared storage may hold what someone else put there. A `.megaframe.lock` planted as a
symlink made the lock truncate and overwrite its target; a `latest` link to /etc/passwd printed
the target into the job log. So the files megaframe itself names there are opened with O_NOFOLLOW
(the last component only: the run dir itself may well be a link the user chose), must be regular
files, are read up to a size cap, and what an error line quotes from them is cut short and
stripped of control characters. O_NONBLOCK keeps a FIFO planted in a file's place from hanging
the open; it does not change reads or writes of a regular file.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, Optional


class UnsafeFile(OSError):
    """A path megaframe names in its directories is a link, a FIFO, a directory, or too large."""


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, for a message: "a FIFO", "a directory", ..."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or special file"


def not_a_file(path: Path) -> Optional[str]:
    """"PATH is a FIFO, not a file megaframe wrote" when something other than a regular file is at
    `path` (not followed: a link is named as one); None when a regular file or nothing is there.
    Where a file megaframe wrote is looked for, a FIFO or a folder of its name was called missing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    target = f" (to {quote(os.readlink(path), 200)})" if stat.S_ISLNK(mode) else ""
    return f"{path} is {kind_of(mode)}{target}, not a file megaframe wrote"


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open(path, flags) that refuses (UnsafeFile, one line naming the path) anything but a
    regular file: a symbolic link is not followed, a FIFO not waited on."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # ENXIO: a FIFO opened write-only
            try:
                kind = kind_of(os.lstat(path).st_mode)
            except OSError:
                kind = "not a regular file"
            raise UnsafeFile(err.errno, f"{path} is {kind}, not a file megaframe wrote", str(path)) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeFile(errno.EINVAL, f"{path} is {kind_of(info.st_mode)}, not a file megaframe wrote", str(path))
    os.set_blocking(fd, True)
    return fd


def create_fresh(path: Path, mode: int = 0o666) -> int:
    """A new, empty regular file at `path` for writing (a temp file about to be renamed): whatever
    was there (a crashed writer's leftover, or a link planted at the predictable name) is removed
    first, never followed, and O_EXCL makes sure the file opened is the one created."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def read_capped(path: Path, cap: int) -> bytes:
    """The bytes of regular file `path` (not a link), refusing (UnsafeFile) one larger than `cap`."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise UnsafeFile(errno.EFBIG, f"{path} holds {size} bytes, more than the {cap} such a file can hold",
                             str(path))
        chunks, left = [], cap + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:  # it grew while we read it
        raise UnsafeFile(errno.EFBIG, f"{path} holds more than the {cap} bytes such a file can hold", str(path))
    return data


def quote(value: Any, cap: int = 60) -> str:
    """`value` as an error line may quote it: at most `cap` characters, control characters and
    anything outside printable ASCII escaped, cut short with '...' (never a file's whole content)."""
    text = value if isinstance(value, str) else str(value)
    shown = "".join(c if " " <= c <= "~" else repr(c)[1:-1] for c in text[:cap])
    return shown + ("..." if len(text) > cap else "")
