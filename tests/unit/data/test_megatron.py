"""Megatron-LM's MMIDIDX datasets, read directly: against Megatron's own reader (megatron-core),
document by document, and one-line errors for malformed files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megaframe.data import DataError, IndexedDataset, open_dataset
from megaframe.data.megatron import MegatronDataset


def _megatron_build(prefix, documents: list[list[list[int]]], dtype=np.uint16) -> None:
    """Write with Megatron's IndexedDatasetBuilder: each document a list of sequences (sentences)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def _random_documents(seed: int, count: int, vocab: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(count)]


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 257), (np.int32, 70_000)])
def test_documents_equal_megatrons_reader(tmp_path, dtype, vocab):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronReader

    prefix = tmp_path / "corpus_text_document"
    _megatron_build(prefix, _random_documents(0, 50, vocab), dtype)
    theirs = MegatronReader(str(prefix))
    ours = open_dataset(prefix, "byte")
    assert isinstance(ours, MegatronDataset) and len(ours) == len(theirs.document_indices) - 1 == 50
    for d in range(len(ours)):
        first, last = theirs.document_indices[d], theirs.document_indices[d + 1]
        expected = np.concatenate([theirs[i] for i in range(first, last)])
        assert np.array_equal(ours[d], expected), d
    assert ours.num_tokens == int(theirs.sequence_lengths.sum())
    assert (ours.vocab_size, ours.eod_id) == (257, 256)  # from data.tokenizer=byte: the files name none


def test_megaframes_own_format_is_still_detected(tmp_path):
    from megaframe.data import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "own", layout="megaframe") as writer:
        writer.add_document([1, 2, 3])
        writer.add_document([4, 256])
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    assert isinstance(open_dataset(tmp_path / "own", "byte"), IndexedDataset)


def test_megaframes_sidecar_names_the_vocabulary_over_data_tokenizer(tmp_path):
    """What megaframe writes (Megatron's layout) carries its tokenizer in the sidecar: a run need not
    name it, and a data.tokenizer that differs is refused (it would be written into checkpoints and
    HF exports), never used over what the tokens were built with."""
    from megaframe.data import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "ds", dtype=np.int32) as writer:
        writer.add_document([1, 70_000, 5])
        writer.finalize({"tokenizer": "some-bpe", "vocab_size": 80_000, "eod_id": 5})
    for tokenizer in (None, "some-bpe"):
        dataset = open_dataset(tmp_path / "ds", tokenizer)
        assert isinstance(dataset, MegatronDataset)
        assert (dataset.vocab_size, dataset.eod_id) == (80_000, 5)
        assert "recorded in" in dataset.vocab_source
    dataset.verify()
    with pytest.raises(DataError, match="set data.tokenizer=some-bpe"):
        open_dataset(tmp_path / "ds", "byte")


def _damage(prefix, how: str) -> None:
    idx, bin_ = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    data = bytearray(idx.read_bytes())
    if how == "magic":
        data[:3] = b"XXX"
    elif how == "truncated index":
        data = data[: len(data) - 5]
    elif how == "dtype":
        data[17] = 42
    idx.write_bytes(bytes(data))
    if how == "short bin":
        bin_.write_bytes(bin_.read_bytes()[:-10])
    if how == "longer bin":  # another build's .bin beside this .idx (a crash mid-replace leaves that)
        bin_.write_bytes(bin_.read_bytes() * 2)


@pytest.mark.parametrize("how,fragment", [
    ("magic", "neither a megaframe (MFTOKIDX) nor a Megatron (MMIDIDX) index (bad magic bytes)"),
    ("truncated index", "expected for 5 sequences and 3 documents (truncated or corrupt)"),
    ("dtype", "unknown dtype code 42"),
    ("short bin", "points past the end of"),
    ("longer bin", "the two files are from different builds"),
])
def test_malformed_files_are_one_line(tmp_path, how, fragment):
    prefix = tmp_path / "bad"
    _megatron_build(prefix, [[[1, 2], [3]], [[4, 5, 6]], [[7], [8, 9]]])
    _damage(prefix, how)
    with pytest.raises(DataError) as err:
        open_dataset(prefix, "byte")
    message = str(err.value)
    assert fragment in message and "\n" not in message and message.startswith(f"data.path={prefix}"), message
