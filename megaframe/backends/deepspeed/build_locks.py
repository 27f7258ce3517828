"""Stale JIT build locks: bounded waits instead of silent hangs.

DeepSpeed JIT-builds its CPU ops (cpu_adam, async_io, pin_memory, shm comm) into the torch
extensions directory. Every load, even of an op already built, takes that op's `lock` file
(torch's FileBaton) while ninja checks the build. A process killed while holding it (a rank hit
by SIGKILL or a job's time limit) leaves the file behind, and every later run waits on it forever
without a word. Before building its engine each rank therefore waits for existing locks, and
removes one that has not changed for `max_age_s` (a build here takes at most a few minutes).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

STALE_AFTER_S = 600.0


def extensions_dir() -> Path:
    """Where torch (and so DeepSpeed) puts JIT-built extensions: TORCH_EXTENSIONS_DIR, else torch's
    per-interpreter default folder."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("", verbose=False))  # the root itself: no op folder is made


def clear_stale_build_locks(root: Path | None = None, max_age_s: float = STALE_AFTER_S, poll_s: float = 1.0,
                            warn: Callable[[str], None] | None = None) -> list[Path]:
    """Wait until no op's build lock under `root` is held; remove (and report) those older than
    max_age_s, i.e. left by a dead process. Returns the removed lock files."""
    root = extensions_dir() if root is None else Path(root)
    warn = warn or (lambda message: print(f"megaframe: warning: {message}", file=sys.stderr, flush=True))
    removed = []
    for lock in sorted(root.glob("*/lock")):
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:  # released: the build it guarded is done
                break
            if age > max_age_s:
                lock.unlink(missing_ok=True)
                removed.append(lock)
                warn(f"removed {lock}: a JIT build lock held for {age / 60:.0f} min by a process that is "
                     f"gone (it would make every later run wait forever)")
                break
            time.sleep(poll_s)
    return removed
