"""Token ids against the model's vocabulary, checked when a dataset is opened, once per dataset.

An id at or above the vocabulary, or below 0 (Megatron's signed dtypes hold -1, which some
pipelines pad with), trains silently at tp > 1 (a zero embedding row of the padding, a target no
logit stands for) and fails deep in the embedding at tp = 1. The smallest and largest ids are found
by a vectorised scan that the ranks share (each reads 1/world of the tokens; the caller reduces
them), and are remembered in the cache, keyed by the dataset's build checksum and the .bin's size
and modification time, so a dataset is scanned once, and again only when its file changes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from megaframe.data.indexed import DataError, IndexedDataset
from megaframe.atomic_io import atomic_write_text

_CHUNK_TOKENS = 1 << 24  # 32-64 MiB of tokens per read


def _cache_file(dataset: IndexedDataset, cache_dir: Path) -> Path:
    stat = dataset.bin_path.stat()
    key = f"{dataset.checksum.hex()}-{stat.st_size}-{stat.st_mtime_ns}"
    return Path(cache_dir) / "token_check" / f"{key}.json"


EMPTY = (1 << 62, -1)  # (smallest, largest) of no tokens: any real id replaces both


def cached_token_range(dataset: IndexedDataset, cache_dir: Path) -> Optional[tuple[int, int]]:
    """(smallest, largest) token id remembered for this exact dataset file, None when never scanned
    (or scanned by a version that recorded the largest only)."""
    try:
        record = json.loads(_cache_file(dataset, cache_dir).read_text())
        return int(record["min_token_id"]), int(record["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember_token_range(dataset: IndexedDataset, cache_dir: Path, found: tuple[int, int]) -> None:
    """Record the scan's (smallest, largest) `found` (atomically: a reader sees the whole file or none)."""
    path = _cache_file(dataset, cache_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"min_token_id": int(found[0]), "max_token_id": int(found[1]),
                                            "prefix": str(dataset.prefix)}))
    except OSError:  # a read-only cache only costs a scan next time
        pass


def token_range(dataset: IndexedDataset, part: int, parts: int) -> tuple[int, int]:
    """(smallest, largest) token id in share `part` of `parts` of the dataset's tokens (EMPTY when
    the share is empty). Unsigned dtypes hold nothing below 0: their minimum is not scanned."""
    total = dataset.num_tokens
    start, end = total * part // parts, total * (part + 1) // parts
    smallest, largest = EMPTY
    signed = np.issubdtype(dataset.tokens.dtype, np.signedinteger)
    for chunk_start in range(start, end, _CHUNK_TOKENS):
        chunk = dataset.tokens[chunk_start:min(end, chunk_start + _CHUNK_TOKENS)]
        largest = max(largest, int(np.max(chunk)))
        smallest = min(smallest, int(np.min(chunk)) if signed else 0)
    return smallest, largest


def check_token_ids(dataset: IndexedDataset, found: tuple[int, int], vocab_size: int, vocab_key: str) -> None:
    """DataError (one line) when the dataset holds an id below 0 or at or above the model's vocabulary."""
    smallest, largest = found
    if smallest < 0:
        raise DataError(
            f"data.path={dataset.prefix}: token id {smallest} is negative (padding or a sentinel in a signed "
            f"dtype); no embedding row stands for it: rebuild the data without it (megaframe-preprocess)")
    if largest >= vocab_size:
        raise DataError(
            f"data.path={dataset.prefix}: token id {largest} is outside the model's vocabulary of {vocab_size} "
            f"({vocab_key}); the data was tokenized with another tokenizer or is corrupt: rebuild it with "
            f"megaframe-preprocess and the model's tokenizer, or set model.vocab_size >= {largest + 1}")
