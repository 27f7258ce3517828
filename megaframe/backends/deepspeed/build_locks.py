"""JIT-built DeepSpeed ops: built once, under a lock that dies with its owner.

DeepSpeed JIT-builds its CPU ops (cpu_adam, async_io, ...) into the torch extensions directory.
Every load, even of an op already built, takes that op's `lock` file (torch's FileBaton), which
records no owner: a process killed while holding it leaves the file behind, and every later run
waits on it forever without a word. Deciding staleness by age is wrong both ways (a cold async_io
build has taken 28 minutes here), so the owner's liveness decides:
- megaframe processes load the ops a run needs under an OS file lock (flock) on
  EXTENSIONS_DIR/megaframe-build.lock, which the kernel releases when its holder dies; a baton
  found while holding it was not left by a live megaframe process;
- a baton of another program's build is recognised by its builder (ninja, the compiler) running
  with its working directory in the op's folder, and is waited for;
- any other baton is stale: removed, with a warning.
Loading the ops here, before deepspeed.initialize, also means initialize finds them loaded
(DeepSpeed keeps loaded ops per process) and takes no baton inside its collectives.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from megaframe.failures import MissingSystemPiece

OWNER_LOCK = "megaframe-build.lock"


def extensions_dir() -> Path:
    """Where torch (and so DeepSpeed) puts JIT-built extensions: TORCH_EXTENSIONS_DIR, else torch's
    per-interpreter default folder."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("", verbose=False))  # the root itself: no op folder is made


def _warn(message: str) -> None:
    print(f"megaframe: warning: {message}", file=sys.stderr, flush=True)


def building_in(folder: Path) -> bool:
    """Whether a live process on this host works in `folder` (ninja and the compiler run there)."""
    target = str(Path(folder).resolve())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone, or not ours to read
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            return True
    return False


@contextmanager
def owner_lock(root: Optional[Path] = None, warn: Callable[[str], None] = _warn) -> Iterator[None]:
    """Hold EXTENSIONS_DIR/megaframe-build.lock (an flock: released by the kernel if we die)."""
    root = extensions_dir() if root is None else Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / OWNER_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            warn(f"waiting for another megaframe process building DeepSpeed ops in {root}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def clear_stale_build_locks(root: Optional[Path] = None, poll_s: float = 1.0,
                            warn: Callable[[str], None] = _warn) -> list[Path]:
    """Call holding owner_lock(): wait for batons whose builder is alive, remove the others (left by
    a dead process). Returns the removed lock files."""
    root = extensions_dir() if root is None else Path(root)
    removed = []
    for lock in sorted(root.glob("*/lock")):
        while lock.exists() and building_in(lock.parent):
            time.sleep(poll_s)
        if lock.exists():
            lock.unlink(missing_ok=True)
            removed.append(lock)
            warn(f"removed {lock}: a JIT build lock whose owner is gone (it would make every later run wait forever)")
    return removed


def load_ops(builder_names: list[str], root: Optional[Path] = None) -> None:
    """Build or load the named DeepSpeed op builders' ops under owner_lock, stale batons cleared first."""
    from deepspeed.accelerator import get_accelerator

    with owner_lock(root):
        clear_stale_build_locks(root)
        for name in builder_names:
            builder = get_accelerator().create_op_builder(name)
            if builder is None:
                continue
            try:
                builder.load(verbose=False)
            except Exception as err:  # a compiler error, a missing library: the cause is in the build log
                detail = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                raise MissingSystemPiece(
                    f"DeepSpeed's {builder.name} op did not build or load ({detail}); its build files are in "
                    f"{extensions_dir() / builder.name}; fix the toolchain or choose an offload that does not "
                    f"need it") from err
