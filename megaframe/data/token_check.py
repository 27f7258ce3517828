"""Token ids against the model's vocabulary, checked when a dataset is opened, once per dataset.

An id at or above the vocabulary trains silently at tp > 1 (a zero embedding row of the padding,
a target no logit stands for) and fails deep in the embedding at tp = 1. The largest id is found
by a vectorised scan that the ranks share (each reads 1/world of the tokens; the caller reduces
the maxima), and is remembered in the cache, keyed by the dataset's build checksum and the .bin's
size and modification time, so a dataset is scanned once, and again only when its file changes.
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


def cached_max_token_id(dataset: IndexedDataset, cache_dir: Path) -> Optional[int]:
    """The largest token id remembered for this exact dataset file, None when never scanned."""
    try:
        return int(json.loads(_cache_file(dataset, cache_dir).read_text())["max_token_id"])
    except (OSError, ValueError, KeyError):
        return None


def remember_max_token_id(dataset: IndexedDataset, cache_dir: Path, found: int) -> None:
    """Record the scan's result `found` (atomically: a reader sees the whole file or none)."""
    path = _cache_file(dataset, cache_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"max_token_id": int(found), "prefix": str(dataset.prefix)}))
    except OSError:  # a read-only cache only costs a scan next time
        pass


def max_token_id(dataset: IndexedDataset, part: int, parts: int) -> int:
    """The largest token id in share `part` of `parts` of the dataset's tokens (-1 when the share is empty)."""
    total = dataset.num_tokens
    start, end = total * part // parts, total * (part + 1) // parts
    largest = -1
    for chunk_start in range(start, end, _CHUNK_TOKENS):
        chunk = dataset.tokens[chunk_start:min(end, chunk_start + _CHUNK_TOKENS)]
        largest = max(largest, int(np.max(chunk)))
    return largest


def check_token_ids(dataset: IndexedDataset, max_id: int, vocab_size: int, vocab_key: str) -> None:
    """DataError (one line) when the dataset holds an id at or above the model's vocabulary."""
    if max_id >= vocab_size:
        raise DataError(
            f"data.path={dataset.prefix}: token id {max_id} is outside the model's vocabulary of {vocab_size} "
            f"({vocab_key}); the data was tokenized with another tokenizer or is corrupt: rebuild it with "
            f"tools/preprocess_data.py and the model's tokenizer, or set model.vocab_size >= {max_id + 1}")
