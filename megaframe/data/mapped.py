"""The files a dataset reads in place, through read-only memory maps, and whether one has shrunk since.

A mapped file truncated or overwritten in place while a run reads it (`cp new.bin data.bin`, `truncate`,
a preprocess writing to the same path by another tool) kills the process with SIGBUS at the first read
past its new end: exit 135, no line, no log. So a step's micro-batches (and an evaluation's batches),
read back to back, first ask the maps how big their files are now (mmap.size() stats the map's own
descriptor: one fstat per file) and a shrunk file is a DataError naming it. A file replaced by a rename
(megaframe-preprocess writes that way) is not a change here: the map keeps the old file, whole (on a
local file system; over NFS a file another client replaced may be unreadable, ESTALE, which this check
cannot tell). What this cannot catch is a truncation in the milliseconds between the check and the
reads; that one still ends in SIGBUS.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Optional

import numpy as np


class MappedFiles:
    """Read-only maps of whole files, one per file however many arrays view it, with each file's size
    when it was mapped."""

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[Optional[mmap.mmap], int]] = {}

    def array(self, path: str | os.PathLike[str], dtype: np.dtype | str, offset: int = 0,
              count: int = -1) -> np.ndarray:
        """A read-only array of `count` `dtype` values (-1: to the end) at byte `offset` of `path`."""
        path = Path(path)
        if path not in self._maps:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                # mmap refuses an empty file; a dataset of empty documents still has one
                self._maps[path] = (mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None, size)
        mapped, _ = self._maps[path]
        if mapped is None or count == 0:
            return np.zeros(0, dtype=dtype)
        return np.frombuffer(mapped, dtype=dtype, count=count, offset=offset)

    def shrunk(self) -> Optional[str]:
        """What shrank since it was mapped, and the fix, or None."""
        for path, (mapped, size) in self._maps.items():
            try:
                now = mapped.size() if mapped is not None else size
            except OSError:  # NFS's ESTALE for a file another client replaced: not a size to compare
                continue
            if now < size:
                return (f"{path} now holds {now} bytes, {size} when this run opened it: changed in place while the "
                        f"run read it; put back the files the run started with and resume (write a new dataset "
                        f"under another prefix rather than over one a run reads)")
        return None
