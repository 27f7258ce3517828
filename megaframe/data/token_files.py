"""What megaframe's and Megatron's token files (indexed.py, megatron.py) share: the error their
readers and writers raise, a header read, and the build checksum the sidecar records."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from megaframe.common.failures import ExitCode
from megaframe.data.index_scan import CHUNK

_HASH_CHUNK_TOKENS = 1 << 24


class DataError(ValueError):
    """Bad data input; the one-line message names the file or argument and how to fix it."""

    exit_code = ExitCode.BAD_DATA  # after launch (megaframe/common/failures.py)


def read_head(path: Path, size: int) -> bytes:
    """The first `size` bytes of a file (fewer when it is shorter; none when it cannot be read):
    a header, without reading the rest."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def content_checksum(tokens: np.ndarray, doc_offsets: np.ndarray) -> bytes:
    """The build checksum the writer records: blake2b-128 over the tokens' bytes, then the document
    offsets as little-endian int64. Hashed in chunks, so a large memory-mapped .bin is never read whole."""
    hasher = hashlib.blake2b(digest_size=16)
    for start in range(0, len(tokens), _HASH_CHUNK_TOKENS):
        hasher.update(np.ascontiguousarray(tokens[start : start + _HASH_CHUNK_TOKENS]).tobytes())
    for start in range(0, len(doc_offsets), CHUNK):  # a Megatron index's offsets are computed, a chunk at a time
        hasher.update(np.asarray(doc_offsets[start : start + CHUNK], dtype="<i8").tobytes())
    return hasher.digest()
