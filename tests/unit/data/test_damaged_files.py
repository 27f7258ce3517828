"""Token files damaged on disk (a copy cut short, an index from another build) are one line naming
the file, with exit code 4 after launch, in both on-disk layouts, before any token is read."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from megaframe.data import DataError, IndexedDatasetWriter, open_dataset
from megaframe.common.failures import ExitCode, classify


def _dataset(prefix: Path, layout: str) -> Path:
    rng = np.random.default_rng(4)
    with IndexedDatasetWriter(prefix, dtype=np.uint16, layout=layout) as writer:
        for _ in range(20):
            writer.add_document(rng.integers(0, 256, size=50))
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    return prefix


def _refused(prefix: Path, *fragments: str) -> None:
    with pytest.raises(DataError) as error:
        open_dataset(prefix)
    message = str(error.value)
    assert "\n" not in message and classify(error.value).exit_code == ExitCode.BAD_DATA == 4
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("layout", ["megatron", "megaframe"])
def test_a_truncated_bin_is_exit_4_naming_it(tmp_path, layout):
    prefix = _dataset(tmp_path / "corpus", layout)
    bin_path = Path(f"{prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-7])
    _refused(prefix, str(bin_path))


def test_a_megatron_idx_pointing_past_the_bin_is_exit_4(tmp_path):
    """The last sequence's length grown by 1,000 (its pointer unchanged): it would read past the file."""
    prefix = _dataset(tmp_path / "corpus", "megatron")
    idx_path = Path(f"{prefix}.idx")
    raw = bytearray(idx_path.read_bytes())
    header = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence and document counts
    last = header + 4 * 19
    (length,) = struct.unpack_from("<i", raw, last)
    struct.pack_into("<i", raw, last, length + 1000)
    idx_path.write_bytes(bytes(raw))
    _refused(prefix, f"{idx_path} points past the end of {prefix}.bin")


def test_a_megaframe_idx_whose_offsets_run_past_the_bin_is_exit_4(tmp_path):
    prefix = _dataset(tmp_path / "corpus", "megaframe")
    idx_path = Path(f"{prefix}.idx")
    raw = bytearray(idx_path.read_bytes())
    struct.pack_into("<q", raw, len(raw) - 8, 10 ** 9)  # the last document offset: a billion tokens
    idx_path.write_bytes(bytes(raw))
    _refused(prefix, str(Path(f"{prefix}.bin")), "expects 2000000000")
