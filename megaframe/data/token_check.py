"""Token ids against the model's vocabulary, checked from the tokens themselves at every start.

An id at or above the vocabulary, or below 0 (Megatron's signed dtypes hold -1, which some
pipelines pad with), trains silently at tp > 1 (the vocab-parallel embedding gives a zero row of
the padding, a target no logit stands for) and fails deep in the embedding at tp = 1. So the
check runs on the data, before any model sees it: the smallest and largest ids are found by a
vectorised scan that the ranks share (each reads 1/world of the tokens; the caller reduces them).

Nothing is cached. A cache keyed on the .bin's size and modification time trusted metadata: a
token changed in place (bit rot, or a copy made with `touch -r`) kept the key, and the corrupt
file trained at tp=2 with exit 0. A content hash would read every byte too, and blake2b is ~35x
slower than numpy's max over the same memmap (200 MB: 0.28 s against 0.008 s, page cache warm),
so the scan itself is the cheapest content check; its cost is one read of 1/world of the tokens.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from megaframe.data.indexed import DataError, IndexedDataset

_CHUNK_TOKENS = 1 << 24  # 32-64 MiB of tokens per read

EMPTY = (1 << 62, -1)  # (smallest, largest) of no tokens: any real id replaces both


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


def dataset_token_ranges(datasets: Sequence[IndexedDataset], part: int, parts: int,
                         reduce_max: Callable[[np.ndarray], np.ndarray]) -> list[tuple[int, int]]:
    """(smallest, largest) id of each dataset over all ranks: this rank scans share `part` of
    `parts` of every dataset; reduce_max takes the (datasets, 2) int64 array [largest, -smallest]
    and returns its element-wise maximum over the ranks (one collective for a whole blend)."""
    local = np.array([(largest, -smallest) for smallest, largest in
                      (token_range(dataset, part, parts) for dataset in datasets)], dtype=np.int64).reshape(-1, 2)
    reduced = np.asarray(reduce_max(local)).reshape(-1, 2)
    return [(-int(negated), int(largest)) for largest, negated in reduced]


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
