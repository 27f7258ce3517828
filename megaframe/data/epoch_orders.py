"""Epoch orders of a large sample set, built once per host and shared by its ranks through one file.

Every rank used to shuffle each epoch's order itself and hold it: at 500M samples (2T tokens of 4k)
that is 2 GiB of int32 per rank, 16 GiB on a node of eight GPUs, and over 2^31 samples (Llama 3's
15T tokens of 4k) int64, 30 GiB per rank; each rank also spent the shuffle's seconds at every epoch
boundary. As Megatron-LM caches its shuffle index (--data-cache-path), the first process on a host
to need an epoch's order writes it to data.cache_dir/orders/ and every process maps that file
read-only: the page cache holds one copy per host, and a later run of the same data and seed loads
it. The order is bitwise the in-memory one (dataset.build_epoch_permutation), so runs do not change
their data when the size crosses SHARED_FROM or the cache is lost.

The file lock only saves duplicate work: the content is a function of its name, written aside and
renamed, so two hosts that build it at once on a shared file system (where flock may not reach
across hosts) write the same bytes. A cache that cannot be written (read-only, full) is not an
error: that process keeps its own order in memory, as before, and says so once."""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from megaframe.data.dataset import build_epoch_permutation, epoch_permutation

# samples from which an order goes through the file (64 MiB of int32); smaller ones stay in memory
SHARED_FROM = 1 << 24


class EpochOrders:
    """orders(seed, epoch, num_samples, stream) -> that epoch's read-only order, as
    build_epoch_permutation gives it: shared through `directory` from `shared_from` samples, in
    this process's memory below it or without a directory."""

    def __init__(self, directory: Optional[Path], shared_from: Optional[int] = None) -> None:
        self.directory = directory
        self.shared_from = SHARED_FROM if shared_from is None else shared_from
        self._unwritable = False
        # a step reaches at most the next epoch of a source; a blend's sources have a stream each
        self._mapped = lru_cache(maxsize=16)(self._map)

    def __call__(self, seed: int, epoch: int, num_samples: int, stream: int = 0) -> np.ndarray:
        if self.directory is None or num_samples < self.shared_from or self._unwritable:
            return epoch_permutation(seed, epoch, num_samples, stream) if stream == 0 else \
                build_epoch_permutation(seed, epoch, num_samples, stream)
        return self._mapped(seed, epoch, num_samples, stream)

    def path(self, seed: int, epoch: int, num_samples: int, stream: int) -> Path:
        return Path(self.directory) / f"order-n{num_samples}-seed{seed}-stream{stream}-epoch{epoch}.npy"

    def _map(self, seed: int, epoch: int, num_samples: int, stream: int) -> np.ndarray:
        path = self.path(seed, epoch, num_samples, stream)
        try:
            found = _load(path, num_samples)
            if found is not None:
                return found
            path.parent.mkdir(parents=True, exist_ok=True)
            with _host_lock(path.with_name(path.name + ".lock")):
                found = _load(path, num_samples)  # another process built it while this one waited
                if found is None:
                    _write(path, build_epoch_permutation(seed, epoch, num_samples, stream))
                    found = _load(path, num_samples)
            if found is not None:
                return found
        except OSError as err:
            print(f"megaframe: warning: data.cache_dir: cannot share epoch orders through {path.parent} "
                  f"({err.strerror or err}); this process keeps its own in memory", file=sys.stderr, flush=True)
        self._unwritable = True
        return build_epoch_permutation(seed, epoch, num_samples, stream)


def _load(path: Path, num_samples: int) -> Optional[np.ndarray]:
    """The order in `path`, mapped read-only, or None when it is missing or not an order of
    num_samples (a file of another shape is rebuilt, never read as this one)."""
    try:
        order = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        return None
    except ValueError:  # not a .npy file (damaged by hand: the writes are atomic)
        return None
    expected = np.int32 if num_samples < 2**31 else np.int64
    return order if order.shape == (num_samples,) and order.dtype == expected else None


def _write(path: Path, order: np.ndarray) -> None:
    """Written aside and renamed: a reader sees the whole order or none."""
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as out:
            np.save(out, order)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


class _host_lock:
    """flock on `path` while the order is built (released by the kernel if the holder dies); where
    the file system has no flock, no lock: the build is then only done twice."""

    def __init__(self, path: Path) -> None:
        self.path, self.handle = path, None

    def __enter__(self) -> "_host_lock":
        self.handle = open(self.path, "a")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX)
        except OSError:
            pass
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()
