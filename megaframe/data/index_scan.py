"""Token indexes read without holding them in memory: the checks of opening walk the memory-mapped
arrays a chunk at a time (megaframe's index and Megatron's), and a Megatron index's document offsets
are computed from its arrays on demand.

Materialised, a Megatron index cost every rank 36 bytes a document while opening and 8 for as long
as the run lasted (measured at 1.5 sequences a document: the lengths widened, the ends, the
cumulative sum, the offsets). A corpus of a billion documents held 8 GB on each rank, 64 GB on an
8-GPU node, and needed 36 GB on each rank to start. Megatron keeps its index memory-mapped, shared
through the page cache by a node's ranks; so does this."""
from __future__ import annotations

import contextlib
import operator
import os
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import numpy as np

CHUNK = 1 << 20  # index entries a check reads at a time: 8 MB per temporary array

T = TypeVar("T")
# what the pre-launch check's walks over whole index files found, by the files' identity (device,
# inode, size, modification and change times), for the next open of the same files in this process (or a rank
# forked from it): an srun or torchrun task checks the data before it trains, then opens it again to
# train, and each walk reads every index entry (20 bytes a document: 100 GB for a blend of 5 billion
# documents, about 40 s of one core). Kept only while remembering (walks_remembered), used once.
_WALKED: dict[tuple, object] = {}
_REMEMBERING: list[bool] = []


@contextlib.contextmanager
def walks_remembered() -> Iterator[None]:
    """Keep the walks made inside for the next open of the same, unchanged files (launch/checks.py)."""
    _REMEMBERING.append(True)
    try:
        yield
    finally:
        _REMEMBERING.pop()


def file_identity(path: os.PathLike) -> tuple:
    """A file as it is now: another content has another size, time or inode (the change time too: a
    copy that keeps the modification time, cp -p or rsync -t, still changes it)."""
    s = os.stat(path)
    return str(path), s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns


def walked_once(paths: tuple[os.PathLike, ...], what: str, walk: Callable[[], T]) -> T:
    """walk()'s result: the one remembered for `what` of these files as they are now (then forgotten),
    else walked; files changed since (another size or time, or replaced) are walked again."""
    key = (what, *(file_identity(path) for path in paths))
    if key in _WALKED:
        return _WALKED.pop(key)  # type: ignore[return-value]
    found = walk()
    if _REMEMBERING:
        _WALKED[key] = found
    return found


@dataclass(frozen=True)
class SequenceScan:
    """What one pass over the sequence lengths and pointers found."""

    negative_length: bool
    min_pointer: int
    max_end: int  # one past the last byte any sequence covers
    back_to_back: bool  # the sequences start at byte 0 and each starts where the one before ends
    last_end: int  # where the last sequence ends (0 without sequences)


def scan_sequences(lengths: np.ndarray, pointers: np.ndarray, item: int) -> SequenceScan:
    """One pass over S lengths (tokens) and S byte pointers, a chunk at a time."""
    negative, min_pointer, max_end, back_to_back, previous_end = False, 0, 0, True, 0
    for start in range(0, len(lengths), CHUNK):
        chunk_lengths = lengths[start:start + CHUNK]
        chunk_pointers = np.asarray(pointers[start:start + CHUNK], dtype=np.int64)
        ends = chunk_pointers + chunk_lengths.astype(np.int64) * item
        negative = negative or bool((chunk_lengths < 0).any())
        min_pointer = min(min_pointer, int(chunk_pointers.min()))
        max_end = max(max_end, int(ends.max()))
        back_to_back = back_to_back and int(chunk_pointers[0]) == previous_end \
            and bool(np.array_equal(chunk_pointers[1:], ends[:-1]))
        previous_end = int(ends[-1])
    return SequenceScan(negative, min_pointer, max_end, back_to_back, previous_end)


def nondecreasing(values: np.ndarray) -> bool:
    """Whether a (memory-mapped) array never decreases, read a chunk at a time."""
    for start in range(0, max(len(values) - 1, 0), CHUNK):
        window = values[start:start + CHUNK + 1]  # one entry of overlap with the next chunk
        if (window[1:] < window[:-1]).any():
            return False
    return True


class DocumentOffsets:
    """The token offset of every document boundary (D + 1 of them), looked up in the index's
    memory-mapped arrays when asked: a document starts at its first sequence's byte pointer over the
    token size, and the index's last entry (S, one past the last sequence) marks the end of the tokens.
    Valid once scan_sequences found the sequences back to back. It reads as the array it replaces
    did: a position, a slice, tolist(), np.asarray()."""

    def __init__(self, pointers: np.ndarray, doc_index: np.ndarray, item: int, total_tokens: int) -> None:
        self._pointers, self._doc_index, self._item, self._total = pointers, doc_index, item, total_tokens

    def __len__(self) -> int:
        return len(self._doc_index)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._token_offsets(np.asarray(self._doc_index[key], dtype=np.int64))
        position = operator.index(key)
        return int(self._token_offsets(np.asarray(self._doc_index[position], dtype=np.int64)))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """All D + 1 offsets at once (8 bytes a document: for tests and small datasets)."""
        return self[:] if dtype is None else self[:].astype(dtype)

    def tolist(self) -> list[int]:
        return self[:].tolist()

    def _token_offsets(self, first_sequence: np.ndarray) -> np.ndarray:
        sequences = len(self._pointers)
        if sequences == 0:
            return np.full_like(first_sequence, self._total)
        inside = first_sequence < sequences
        pointers = np.asarray(self._pointers[np.where(inside, first_sequence, 0)], dtype=np.int64)
        return np.where(inside, pointers // self._item, self._total)
