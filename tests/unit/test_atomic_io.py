"""sync_filesystem (common/atomic_io.py), the flush of DeepSpeed's own checkpoint files: a write-back
error syncfs reports ends the save, where it used to fall back to os.sync, which reports nothing, and
the checkpoint was hashed from the page cache, published, and the older ones pruned."""
from __future__ import annotations

import ctypes
import errno
import os

import pytest

from megaframe.common.atomic_io import sync_filesystem


class _Libc:
    """libc whose syncfs fails with `code` (0: succeeds); records whether os.sync ran instead."""

    def __init__(self, code: int):
        self.code = code

    def syncfs(self, fd: int) -> int:
        if not self.code:
            return 0
        ctypes.set_errno(self.code)
        return -1


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EDQUOT])
def test_a_write_back_error_is_raised_not_lost(tmp_path, monkeypatch, code):
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _Libc(code))
    synced = []
    monkeypatch.setattr(os, "sync", lambda: synced.append(True))
    with pytest.raises(OSError) as raised:
        sync_filesystem(tmp_path)
    assert raised.value.errno == code and str(tmp_path) in str(raised.value) and not synced


@pytest.mark.parametrize("code, falls_back", [(0, False), (errno.ENOSYS, True)])
def test_a_kernel_without_syncfs_falls_back_to_sync(tmp_path, monkeypatch, code, falls_back):
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _Libc(code))
    synced = []
    monkeypatch.setattr(os, "sync", lambda: synced.append(True))
    sync_filesystem(tmp_path)
    assert bool(synced) is falls_back


def test_the_real_syncfs_flushes_without_error(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    sync_filesystem(tmp_path)


def test_a_write_that_fails_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    """ENOSPC while writing metrics.jsonl's rewrite (truncate_after) left a temp as large as the file."""
    from megaframe.common.atomic_io import atomic_write_text

    target = tmp_path / "metrics.jsonl"
    target.write_text("the last good copy\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        atomic_write_text(target, "x" * 100_000)
    assert target.read_text() == "the last good copy\n" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]
