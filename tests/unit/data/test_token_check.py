"""The token-id check reads the tokens, not the file's metadata (data/token_check.py)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from megaframe.data import DataError, IndexedDatasetWriter, open_dataset
from megaframe.data.token_check import check_token_ids, dataset_token_ranges, token_range
from megaframe.common.failures import ExitCode, classify


def _byte_dataset(prefix: Path, dtype=np.uint16, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for _ in range(50):
            writer.add_document(rng.integers(0, 256, size=100))
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    return prefix


def _edit_in_place_keeping_mtime(prefix: Path, dtype, position: int, value: int) -> None:
    """What bit rot (or `cp` then `touch -r`) does: one token changes, size and mtime do not."""
    bin_path = Path(f"{prefix}.bin")
    before = bin_path.stat()
    tokens = np.memmap(bin_path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r+")
    tokens[position] = value
    tokens.flush()
    del tokens
    os.utime(bin_path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = bin_path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _whole(local: np.ndarray) -> np.ndarray:
    return local  # one rank: the reduction is the rank's own share


def test_a_token_changed_in_place_with_its_mtime_restored_is_exit_4(tmp_path):
    prefix = _byte_dataset(tmp_path / "corpus")
    (found,) = dataset_token_ranges([open_dataset(prefix)], 0, 1, _whole)
    check_token_ids(open_dataset(prefix), found, 257, "model.vocab_size")  # the clean file passes
    _edit_in_place_keeping_mtime(prefix, np.uint16, 2345, 300)
    dataset = open_dataset(prefix)
    (found,) = dataset_token_ranges([dataset], 0, 1, _whole)
    assert found[1] == 300
    with pytest.raises(DataError) as error:
        check_token_ids(dataset, found, 257, "model.vocab_size")
    message = str(error.value)
    assert "\n" not in message and "token id 300 is outside the model's vocabulary of 257" in message
    assert classify(error.value).exit_code == ExitCode.BAD_DATA == 4


def test_the_ranks_shares_reduce_to_each_datasets_range_in_one_collective(tmp_path):
    """Three ranks' shares of a blend of two datasets: only one share holds each bad id, and one
    reduction (the caller's all_reduce) over a (datasets, 2) array finds them all."""
    clean = open_dataset(_byte_dataset(tmp_path / "clean", seed=1))
    signed = _byte_dataset(tmp_path / "signed", dtype=np.int32, seed=2)
    _edit_in_place_keeping_mtime(signed, np.int32, 4321, -1)
    signed = open_dataset(signed)
    shares = [token_range(signed, part, 3) for part in range(3)]
    assert sorted(low for low, _ in shares) == [-1, 0, 0]
    calls = []

    def reduce_max(local: np.ndarray) -> np.ndarray:  # what all_reduce(MAX) returns over the 3 ranks
        calls.append(local.shape)
        every = [np.array([(hi, -lo) for lo, hi in (token_range(d, part, 3) for d in (clean, signed))])
                 for part in range(3)]
        return np.maximum.reduce(every)

    found = dataset_token_ranges([clean, signed], 1, 3, reduce_max)
    assert calls == [(2, 2)] and found == [(0, 255), (-1, 255)]
    check_token_ids(clean, found[0], 257, "model.vocab_size")
    with pytest.raises(DataError, match="token id -1 is negative"):
        check_token_ids(signed, found[1], 257, "model.vocab_size")
