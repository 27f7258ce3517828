"""Writing state so that no reader, and no crash, ever sees half a file.

Atomic is not durable: a rename or a new file lives in the page cache (on Lustre/NFS in the
client's write-back cache) until it is fsync'd, so a node that dies seconds later can lose it.
fsync_file and fsync_dir make a write and a directory's entries (a rename, a new file) durable.
"""
from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path

from megaframe.common.safe_files import create_fresh

# a directory fsync some filesystems refuse (they order metadata themselves): nothing to do there
_DIR_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF)


def fsync_file(path: Path) -> None:
    """Flush a file written by this process (closed already) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (files created or renamed in it) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def sync_filesystem(path: Path) -> None:
    """Flush this node's writes to the file system holding `path` (Linux syncfs; os.sync where libc
    has none): for a writer that neither fsyncs nor names its files (DeepSpeed's engine). One call
    per rank, where listing a shared directory and fsyncing every rank's new files from every rank
    would cost each of thousands of ranks as many fsyncs as there are ranks. A write-back error it
    reports (EIO, ENOSPC, EDQUOT: Linux 5.8 on) is raised: the files' bytes may never reach the disk,
    and a checkpoint hashed from the page cache would be published and the older ones pruned."""
    import ctypes

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
        if syncfs is None:
            os.sync()
        elif syncfs(fd) != 0:
            err = ctypes.get_errno()
            if err != errno.ENOSYS:  # a kernel without syncfs: os.sync, which reports nothing, is all there is
                raise OSError(err, os.strerror(err), str(path))
            os.sync()
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename, so readers never see half a file;
    durable on return (the file and the rename are fsync'd).
    The temp file is named by host and process: ranks on several hosts may write the same path on
    shared storage (the last rename wins, whole)."""
    tmp = path.with_name(f".{path.name}.tmp.{socket.gethostname()}.{os.getpid()}")
    try:
        with os.fdopen(create_fresh(tmp), "w") as f:  # a link planted at the temp name is not followed
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: no second copy's worth of bytes left beside the file
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(Path(path).parent)
