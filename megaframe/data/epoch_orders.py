"""Epoch orders of a large sample set, built once per host and shared by its ranks through one file.

Every rank used to shuffle each epoch's order itself and hold it: at 500M samples (2T tokens of 4k)
that is 2 GiB of int32 per rank, 16 GiB on a node of eight GPUs, and over 2^31 samples (Llama 3's
15T tokens of 4k) int64, 30 GiB per rank; each rank also spent the shuffle's seconds at every epoch
boundary. As Megatron-LM caches its shuffle index (--data-cache-path), the first process on a host
to need an epoch's order writes it to data.cache_dir/orders/ and every process maps that file
read-only: the page cache holds one copy per host, and a later run of the same data and seed loads
it. The order is bitwise the in-memory one (build_epoch_permutation), so runs do not change
their data when the size crosses SHARED_FROM or the cache is lost.

The file lock only saves duplicate work: the content is a function of its name (which holds the
format and numpy's version), written aside and linked to its name, so two hosts that build it at once
on a shared file system (where flock may not reach across hosts) publish one file of the same bytes.
A cache that cannot be written (read-only, full) is not an error: that process keeps its own order in
memory, as before, and says so once."""
from __future__ import annotations

import fcntl
import os
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from megaframe.data.temp_files import open_temp, remove_orphans

# samples from which an order goes through the file (64 MiB of int32); smaller ones stay in memory
SHARED_FROM = 1 << 24


def build_epoch_permutation(seed: int, epoch: int, num_samples: int, stream: int = 0) -> np.ndarray:
    """The order of a sample set's epoch: seeded by (seed, epoch), and by `stream` (a blend's source
    number + 1) too when it is not 0. Read-only. int32 below 2^31 samples: every rank holds the
    epochs it is in, and at 500M samples (2T tokens of 4k) int64 took 4 GB a rank; the shuffle draws
    the same swaps whatever the dtype, so the order is Generator.permutation(num_samples)'s."""
    key = [seed, epoch] if stream == 0 else [seed, stream, epoch]
    permutation = np.arange(num_samples, dtype=np.int32 if num_samples < 2**31 else np.int64)
    np.random.default_rng(key).shuffle(permutation)
    permutation.setflags(write=False)
    return permutation


# one sample set's orders, cached: a step touches its current epoch and perhaps the next (a blend
# keeps its sources' orders itself, BlendedSamples._order)
epoch_permutation = lru_cache(maxsize=16)(build_epoch_permutation)


class EpochOrders:
    """orders(seed, epoch, num_samples, stream) -> that epoch's read-only order, as
    build_epoch_permutation gives it: shared through `directory` from `shared_from` samples, in
    this process's memory below it or without a directory."""

    def __init__(self, directory: Optional[Path], shared_from: Optional[int] = None) -> None:
        self.directory = directory
        self.shared_from = SHARED_FROM if shared_from is None else shared_from
        self._unwritable = False
        self._prefetched: set[tuple[int, int, int, int]] = set()  # next epochs built on a thread
        self.prefetches: list[threading.Thread] = []  # those threads (daemons: an exit does not wait)
        # a step reaches at most the next epoch of a source; a blend's sources have a stream each
        self._mapped = lru_cache(maxsize=16)(self._map)

    def __call__(self, seed: int, epoch: int, num_samples: int, stream: int = 0) -> np.ndarray:
        if self.directory is None or num_samples < self.shared_from or self._unwritable:
            return _in_memory(seed, epoch, num_samples, stream)
        try:
            return self._mapped(seed, epoch, num_samples, stream)
        except _NotShared as failed:  # not cached: later calls go to memory at once
            self._unwritable = True
            print(f"megaframe: warning: data.cache_dir: cannot share epoch orders through {self.directory} "
                  f"({failed.reason}); this process keeps its own in memory", file=sys.stderr, flush=True)
            return failed.order if failed.order is not None else _in_memory(seed, epoch, num_samples, stream)

    def path(self, seed: int, epoch: int, num_samples: int, stream: int) -> Path:
        return Path(self.directory) / f"order-{FORMAT}-n{num_samples}-seed{seed}-stream{stream}-epoch{epoch}.npy"

    def _map(self, seed: int, epoch: int, num_samples: int, stream: int) -> np.ndarray:
        path, order = self.path(seed, epoch, num_samples, stream), None
        try:
            found = _load(path, num_samples)
            if found is None:
                order = _build_once(path, seed, epoch, num_samples, stream)
                found = _load(path, num_samples)
        except OSError as err:
            raise _NotShared(err.strerror or str(err), getattr(err, "order", order)) from None
        if found is None:
            raise _NotShared(f"{path.name} is not the order it names (damaged); delete it to share the orders again",
                             order)
        return found

    def reached(self, seed: int, epoch: int, num_samples: int, stream: int, position: int) -> None:
        """A step took the epoch's order up to `position`: from PREFETCH_FROM of the epoch on, the next
        epoch's file is built on a thread (most pre-training runs never finish an epoch: they build
        none)."""
        if (self.directory is not None and num_samples >= self.shared_from and not self._unwritable
                and position >= PREFETCH_FROM * num_samples):
            self._prefetch(seed, epoch + 1, num_samples, stream)

    def _prefetch(self, seed: int, epoch: int, num_samples: int, stream: int) -> None:
        """Build the next epoch's file on a thread, once per process, while this epoch trains: its
        shuffle (seconds to minutes at scale, numpy's without the GIL) then stalls no step at the
        epoch boundary. One at a time (a blend's sources all start their first epoch at step 0: at
        once, their next orders together would be the whole set's in memory). A failure here is left
        to the step that needs the order."""
        if (key := (seed, epoch, num_samples, stream)) in self._prefetched:
            return
        self._prefetched.add(key)
        path = self.path(seed, epoch, num_samples, stream)
        before = self.prefetches[-1] if self.prefetches else None

        def build() -> None:
            try:
                if before is not None:
                    before.join()
                if _load(path, num_samples) is None:
                    _build_once(path, seed, epoch, num_samples, stream)
            except Exception:  # noqa: BLE001 - the foreground path says what is wrong, if anything
                pass
        thread = threading.Thread(target=build, name="megaframe-next-epoch-order", daemon=True)
        self.prefetches.append(thread)
        thread.start()


def _build_once(path: Path, seed: int, epoch: int, num_samples: int, stream: int) -> Optional[np.ndarray]:
    """Under the host's lock, build and publish the order unless another process did meanwhile;
    the order built here, or None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _host_lock(path.with_name(path.name + ".lock")):
        if _load(path, num_samples) is not None:
            return None
        remove_orphans(path, suffixes=(TEMP_SUFFIX,))  # what a writer killed on this host left
        order = build_epoch_permutation(seed, epoch, num_samples, stream)
        try:
            _publish(path, order)
        except OSError as err:
            err.order = order  # the caller uses it rather than shuffle again
            raise
        return order


# in the file names: a change of the shuffle (ours, or numpy's Generator stream, which NEP 19 does not
# fix across versions) must not serve an order built by another one
FORMAT = "v1-numpy" + ".".join(np.__version__.split(".")[:2])
TEMP_SUFFIX = "order"  # temp_files' naming: .NAME.order.HOST-PID.XXXXXXXX.tmp
PREFETCH_FROM = 0.9  # of an epoch's samples taken: then the next epoch's order is built ahead


class _NotShared(Exception):
    def __init__(self, reason: str, order: Optional[np.ndarray]) -> None:
        super().__init__(reason)
        self.reason, self.order = reason, order


def _in_memory(seed: int, epoch: int, num_samples: int, stream: int) -> np.ndarray:
    # a blend keeps its sources' orders itself (blend.py): only stream 0 goes through the process-wide cache
    return epoch_permutation(seed, epoch, num_samples, stream) if stream == 0 else \
        build_epoch_permutation(seed, epoch, num_samples, stream)


# np.load parses a .npy header with ast.literal_eval; two threads doing so at once (the next epoch's
# prefetch and a step's load) raised "SystemError: AST constructor recursion depth mismatch" on
# Python 3.11.7 (CPython gh-106905): one parse at a time
_HEADER_PARSE = threading.Lock()


def _load(path: Path, num_samples: int) -> Optional[np.ndarray]:
    """The order in `path`, mapped read-only, or None when it is missing or not an order of
    num_samples (a file of another shape is rebuilt, never read as this one)."""
    try:
        with _HEADER_PARSE:
            order = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        return None
    except (ValueError, EOFError):  # not a .npy file, or empty (damaged by hand: the writes are atomic)
        return None
    expected = np.int32 if num_samples < 2**31 else np.int64
    if order.shape != (num_samples,) or order.dtype != expected:
        return None
    return order if _sums_of_a_permutation(order) else None


_CHECK_CHUNK = 1 << 22  # samples checked at a time (chunk.sum's int64 cannot overflow within one)


def _sums_of_a_permutation(order: np.ndarray) -> bool:
    """Whether the order's values lie in [0, n) and have the sum and the exclusive-or of 0..n-1. The
    file's name vouched for its content, so one of zeros trained every step on sample 0 and exited 0.
    Not a proof of a permutation, but damage by hand or by a disk does not pass it. 21 ms for 2^24
    samples on the CI host, against 1.35 s for the shuffle it saves; once per epoch and process."""
    n, total, xor = len(order), 0, 0
    for start in range(0, n, _CHECK_CHUNK):
        chunk = order[start:start + _CHECK_CHUNK]
        if len(chunk) and (int(chunk.min()) < 0 or int(chunk.max()) >= n):
            return False
        total += int(chunk.sum(dtype=np.int64))
        xor ^= int(np.bitwise_xor.reduce(chunk))
    last = n - 1  # 0 ^ 1 ^ ... ^ last repeats with period 4
    return total == n * last // 2 and xor == (last, 1, last + 1, 0)[last % 4] if n else True


def _damaged(path: Path, num_samples: int) -> bool:
    """Whether `path` holds a file that is not this order. A missing one is not: unlinking the name
    after finding it missing would remove the file another host published meanwhile (all hosts build
    the next epoch's order at 90% of this one), under the ranks there that map it (on NFS: ESTALE)."""
    return path.exists() and _load(path, num_samples) is None


def _publish(path: Path, order: np.ndarray) -> None:
    """Written aside, then linked to its name: a reader sees the whole order or none, and a file
    another host published meanwhile (where the lock does not reach across hosts) is kept, not
    replaced under the ranks that map it (on NFS a replaced file's pages can no longer be read)."""
    handle, partial = open_temp(path.parent, path.name, TEMP_SUFFIX)
    try:
        os.fchmod(handle, 0o644)  # mkstemp's 0600 would keep the other users of a shared cache out
        with os.fdopen(handle, "wb") as out:
            np.save(out, order)
            out.flush()
            os.fsync(out.fileno())
        if _damaged(path, len(order)):
            path.unlink(missing_ok=True)  # nobody can be reading it as an order
        try:
            os.link(partial, path)
        except FileExistsError:
            pass  # published by another host since: the same bytes
        except OSError:  # a file system without hard links
            os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)


# The lock handles this process holds. A flock belongs to the open file, which a fork shares: a child
# forked while a build-ahead thread holds one (the thread is not in the child, so nothing there would
# ever close it) would keep every other rank of the host waiting on that order for the child's life.
_HELD: set[int] = set()


def _drop_inherited_locks() -> None:
    """In a forked child: close the lock handles the parent held (the parent's locks stay held)."""
    for handle in list(_HELD):
        _HELD.discard(handle)
        os.close(handle)


os.register_at_fork(after_in_child=_drop_inherited_locks)


class _host_lock:
    """flock on `path` while the order is built (released by the kernel if the holder dies; never
    passed on to a forked child); where the file system has no flock, no lock: the build is then
    only done twice."""

    def __init__(self, path: Path) -> None:
        self.path, self.handle = path, None

    def __enter__(self) -> "_host_lock":
        # read-only: flock needs no write access, and another user of a shared cache has none
        self.handle = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
        _HELD.add(self.handle)
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX)
        except OSError:
            pass
        return self

    def __exit__(self, *exc) -> None:
        _HELD.discard(self.handle)
        os.close(self.handle)


IN_MEMORY = EpochOrders(None)  # every order in this process's memory: small sets, and no data.cache_dir
