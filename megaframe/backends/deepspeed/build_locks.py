"""JIT-built DeepSpeed ops: built once, under a lock that dies with its owner.

DeepSpeed JIT-builds its CPU ops (cpu_adam, async_io, ...) into the torch extensions directory.
Every load, even of an op already built, takes that op's `lock` file (torch's FileBaton), which
records no owner: a process killed while holding it leaves the file behind, and every later run
waits on it forever without a word. Deciding staleness by age is wrong both ways (a cold async_io
build has taken 28 minutes here), so the owner's liveness decides:
- megaframe processes load the ops a run needs under an OS file lock (flock) on
  EXTENSIONS_DIR/megaframe-build.lock, which the kernel releases when its holder dies; a baton
  found while holding it was not left by a live megaframe process;
- a baton of another program's build has a live owner while some process holds the lock file open
  (torch's FileBaton keeps the descriptor it created the file with until it releases) or a builder
  (ninja, the compiler) runs with its working directory in the op's folder; it is waited for, up
  to MEGAFRAME_BUILD_WAIT_S (an hour), then the run ends with one line and exit 6;
- any other baton is stale: removed, with a warning, once the same file has stayed ownerless for
  RELEASE_GRACE_S. A live owner closes its descriptor an instant before it removes the file, and
  a builder's shell runs `rm lock` only after ninja has exited: judging in that instant removed a
  live baton (CI saw it under load), and the owner's own removal then fails.
Ops are built without debug information (DeepSpeed passes -g): nobody steps through these ops, and
-g made a cold async_io build half as long again. An op's sources that include torch are compiled
as one unit (one_unit.py), which parses torch's headers once rather than once per source; an op whose
headers forbid that (async_io) compiles each such source against one precompiled torch header
(shared_header.py), which GCC parses once per op.
Loading the ops here, before deepspeed.initialize, also means initialize finds them loaded
(DeepSpeed keeps loaded ops per process) and takes no baton inside its collectives.
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from megaframe.backends.deepspeed.one_unit import (back_to_deepspeeds_sources, compile_as_one_unit, mark_failed,
                                                   unit_failed)
from megaframe.backends.deepspeed.shared_header import compile_with_shared_header, precompiled
from megaframe.common.failures import MissingSystemPiece

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


# what runs in an op's folder while it builds; a shell, an editor or a `less` left open there is not a
# build (one such shell used to hang every run forever)
BUILDERS = frozenset({"ninja", "make", "cc", "c++", "gcc", "g++", "clang", "clang++", "cc1", "cc1plus", "nvcc",
                      "cicc", "ptxas", "ld", "ld.gold", "ld.lld", "collect2", "as", "hipcc"})
WAIT_ENV = "MEGAFRAME_BUILD_WAIT_S"  # how long a run waits for another process's build of an op
DEFAULT_WAIT_S = 3600.0  # a cold async_io build has taken 28 minutes on a 2-core host
RELEASE_GRACE_S = 0.5  # how long a baton must stay ownerless (the same file) before it counts as stale


def _processes() -> Iterator[Path]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield entry


def building_in(folder: Path) -> bool:
    """Whether a live compiler or build tool on this host works in `folder` (ninja and the compiler
    run there while torch JIT-builds an op)."""
    target = str(Path(folder).resolve())
    for process in _processes():
        try:
            cwd = os.readlink(process / "cwd")
            name = (process / "comm").read_text().strip()
        except OSError:  # gone, or not ours to read
            continue
        if (cwd == target or cwd.startswith(target + os.sep)) and name in BUILDERS:
            return True
    return False


def held_open(lock: Path) -> bool:
    """Whether a live process on this host has `lock` open: torch's FileBaton holds the descriptor it
    created the lock with for the whole build, the Python steps between compiler runs included."""
    target = str(Path(lock).resolve())
    for process in _processes():
        try:
            descriptors = list((process / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor) == target:
                    return True
            except OSError:
                continue
    return False


def _owner_alive(lock: Path) -> bool:
    return held_open(lock) or building_in(lock.parent)


def _inode(path: Path) -> Optional[int]:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def wait_limit_s() -> float:
    """MEGAFRAME_BUILD_WAIT_S, else an hour."""
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)))
    except ValueError:
        return DEFAULT_WAIT_S


def _gave_up(what: str, waited_s: float) -> MissingSystemPiece:
    return MissingSystemPiece(
        f"waited {waited_s:.0f} s for {what} and gave up ({WAIT_ENV}={wait_limit_s():g}); let that build finish, "
        f"or stop it, or give this run its own TORCH_EXTENSIONS_DIR")


@contextmanager
def owner_lock(root: Optional[Path] = None, warn: Callable[[str], None] = _warn,
               limit_s: Optional[float] = None, poll_s: float = 0.2) -> Iterator[None]:
    """Hold EXTENSIONS_DIR/megaframe-build.lock (an flock: released by the kernel if we die),
    waiting at most limit_s (wait_limit_s()) for another holder: MissingSystemPiece after that."""
    root = extensions_dir() if root is None else Path(root)
    limit_s = wait_limit_s() if limit_s is None else limit_s
    root.mkdir(parents=True, exist_ok=True)
    with open(root / OWNER_LOCK, "a") as handle:
        start, warned = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= limit_s:
                    raise _gave_up(f"another megaframe process building DeepSpeed ops in {root}", waited) from None
                if not warned:
                    warn(f"waiting for another megaframe process building DeepSpeed ops in {root}")
                    warned = True
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def clear_stale_build_locks(root: Optional[Path] = None, poll_s: float = 1.0,
                            warn: Callable[[str], None] = _warn, limit_s: Optional[float] = None) -> list[Path]:
    """Call holding owner_lock(): wait (at most limit_s, wait_limit_s()) for batons whose owner is
    alive, remove the others (left by a dead process). Returns the removed lock files."""
    root = extensions_dir() if root is None else Path(root)
    limit_s = wait_limit_s() if limit_s is None else limit_s
    start = time.monotonic()
    removed = []
    for lock in sorted(root.glob("*/lock")):
        ownerless = None  # (inode, since): this very file seen with no live owner
        while (inode := _inode(lock)) is not None:
            if _owner_alive(lock):
                ownerless = None
                if (waited := time.monotonic() - start) >= limit_s:
                    raise _gave_up(f"the build of {lock.parent.name} running in {lock.parent}", waited)
                time.sleep(poll_s)
                continue
            if ownerless is None or ownerless[0] != inode:
                ownerless = (inode, time.monotonic())
            if time.monotonic() - ownerless[1] < RELEASE_GRACE_S:
                time.sleep(min(poll_s, RELEASE_GRACE_S / 5))  # an owner releasing: the file goes within this
                continue
            lock.unlink(missing_ok=True)
            removed.append(lock)
            warn(f"removed {lock}: a JIT build lock whose owner is gone (it would make every later run wait forever)")
            break
    return removed


def ops_for(offload) -> list[str]:
    """The DeepSpeed ops a run with this offload config (cfg.offload) JIT-loads: CPU Adam for an
    offloaded optimizer, async IO for NVMe."""
    ops = ["CPUAdamBuilder"] if offload.optimizer != "none" else []
    return ops + (["AsyncIOBuilder"] if "nvme" in (offload.optimizer, offload.param) else [])


def _without_debug_info(builder) -> None:
    """Drop -g from this builder's compiler flags (an instance attribute shadows the class's method)."""
    flags = builder.cxx_args
    builder.cxx_args = lambda: [flag for flag in flags() if flag != "-g"]


def answer_cpu_info_once() -> None:
    """py-cpuinfo's get_cpu_info starts a Python interpreter on each call (1.2 CPU-s on the 2-core host),
    and DeepSpeed asks it twice for each CPU op's compiler flags and once more for each CPU Adam: a rank
    with an offloaded optimizer paid 3.6 CPU-s for one answer. This process (and the ranks it forks)
    keeps the first answer; each caller gets its own copy."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "megaframe_once", False):
        return
    ask = cpuinfo.get_cpu_info
    answer = functools.cache(lambda: json.dumps(ask()))

    def get_cpu_info() -> dict:
        return json.loads(answer())

    get_cpu_info.megaframe_once = True
    cpuinfo.get_cpu_info = get_cpu_info


def _with_prerequisites(builder_names: list[str]) -> list[str]:
    """DeepSpeed's async_io loads pin_memory itself, with a builder of its own: loaded here first (DeepSpeed
    keeps it per process), it is built as load_ops builds ops (one_unit.py) and under the owner lock."""
    names = []
    for name in builder_names:
        if name == "AsyncIOBuilder" and "PinMemoryBuilder" not in names:
            names.append("PinMemoryBuilder")
        if name not in names:
            names.append(name)
    return names


def _load(builder) -> None:
    try:
        builder.load(verbose=False)
    except Exception as err:  # a compiler error, a missing library: the cause is in the build log
        detail = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise MissingSystemPiece(
            f"DeepSpeed's {builder.name} op did not build or load ({detail}); its build files are in "
            f"{extensions_dir() / builder.name}; fix the toolchain or choose an offload that does not "
            f"need it") from err


def _build_or_load(builder, warn: Callable[[str], None]) -> None:
    """Load the op, its torch-including sources compiled as one unit (one_unit.py), or, where its headers
    forbid one unit (async_io), each against one precompiled torch header (shared_header.py); if that does
    not build, DeepSpeed's own way (and a marker, so later runs do not try it again)."""
    unit = compile_as_one_unit(builder, extensions_dir())
    # an op whose unit failed here goes DeepSpeed's way, as before; the shared header is for ops that never had one
    shared = unit is None and not unit_failed(builder, extensions_dir())
    header = compile_with_shared_header(builder, extensions_dir()) if shared else None
    generated = unit or header
    if generated is None:
        return _load(builder)
    try:
        with precompiled(header, warn):
            builder.load(verbose=False)
        return
    except Exception as err:
        back_to_deepspeeds_sources(builder)
        _load(builder)  # DeepSpeed's way: if this fails too, the cause was not the unit or the wrappers
        mark_failed(generated)
        how = "as one unit" if unit is not None else "against a precompiled torch header"
        warn(f"DeepSpeed's {builder.name} op did not compile {how} ({type(err).__name__}); built its way instead")


def load_ops(builder_names: list[str], root: Optional[Path] = None, warn: Callable[[str], None] = _warn) -> None:
    """Build or load the named DeepSpeed op builders' ops under owner_lock, stale batons cleared first."""
    if not builder_names:
        return  # no op to load, no lock to take: a stale baton of an op this run does not use is no reason to wait
    from deepspeed.accelerator import get_accelerator

    answer_cpu_info_once()
    with owner_lock(root):
        clear_stale_build_locks(root)
        for name in _with_prerequisites(builder_names):
            builder = get_accelerator().create_op_builder(name)
            if builder is None:
                continue
            _without_debug_info(builder)
            _build_or_load(builder, warn)
