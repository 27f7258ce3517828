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


def _raw_index(prefix, lengths, pointers, doc_index, dtype=np.uint16, bin_tokens=None) -> None:
    """An index written field by field (Megatron's layout, version 1), for files its builder would
    not write: corrupt ones, and ones too large to build sequence by sequence in a test."""
    import struct

    from megaframe.data.megatron import MAGIC
    lengths, pointers, doc_index = (np.asarray(a, dtype=t) for a, t in ((lengths, "<i4"), (pointers, "<i8"),
                                                                       (doc_index, "<i8")))
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[np.dtype(dtype)]
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, 1, code, len(lengths), len(doc_index)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())
    tokens = int(lengths.sum()) if bin_tokens is None else bin_tokens
    np.arange(tokens, dtype=dtype).tofile(f"{prefix}.bin")


def test_a_large_index_is_checked_and_read_without_being_held_in_memory(tmp_path, monkeypatch):
    """Opening a Megatron dataset held ~40 bytes a document while checking it and kept 8 (its token
    offsets) for the run: 8 GB on every rank for a billion documents. Now the checks read the
    memory-mapped index a chunk at a time and the offsets are looked up on demand; the documents
    read are unchanged (two sequences in some documents, so the document index is not the identity)."""
    import tracemalloc

    from megaframe.data import index_scan

    rng = np.random.default_rng(0)
    documents = 300_000
    sequences_per_document = rng.integers(1, 3, documents)
    doc_index = np.concatenate([[0], np.cumsum(sequences_per_document)])
    lengths = rng.integers(1, 4, int(doc_index[-1])).astype("<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * 2)[:-1]])
    prefix = tmp_path / "large"
    _raw_index(prefix, lengths, pointers, doc_index)
    expected_offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])[doc_index]  # tokens, not bytes

    monkeypatch.setattr(index_scan, "CHUNK", 4096)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        dataset = MegatronDataset(prefix, vocab_size=1 << 16, eod_id=0)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    index_bytes = 8 * documents  # what the offsets alone took before
    assert held - before < index_bytes / 20, (held - before, index_bytes)
    assert peak - before < index_bytes / 4, (peak - before, index_bytes)

    assert len(dataset) == documents and dataset.num_tokens == int(lengths.sum())
    assert np.array_equal(dataset.doc_offsets[:], expected_offsets)
    assert np.array_equal(dataset.doc_offsets[1000:1010], expected_offsets[1000:1010])
    assert dataset.doc_offsets[-1] == expected_offsets[-1] and dataset.doc_offsets[7] == expected_offsets[7]
    tokens = np.arange(int(lengths.sum()), dtype=np.uint16)
    for d in (0, 1, 4095, 4096, documents - 1):
        assert np.array_equal(dataset[d], tokens[expected_offsets[d]:expected_offsets[d + 1]]), d


@pytest.mark.parametrize("how,fragment", [
    ("negative length", "holds negative sequence lengths"),
    ("gap between sequences", "the sequences are not stored back to back"),
    ("first sequence not at 0", "the sequences are not stored back to back"),
    ("document index goes back", "its document index does not run from 0"),
    ("document index ends early", "its document index does not run from 0"),
])
@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_damage_anywhere_in_the_index_is_found_whichever_chunk_it_falls_in(tmp_path, monkeypatch, how, fragment,
                                                                          chunk):
    """The chunked checks find what the whole-array ones found, at a chunk's edge too (chunk 3: the
    damage at entry 6 sits on a boundary; the sequences and document index are 10 and 8 long)."""
    from megaframe.data import index_scan

    monkeypatch.setattr(index_scan, "CHUNK", chunk)
    lengths = np.full(10, 2)
    pointers = np.arange(10) * 4
    doc_index = np.array([0, 1, 2, 3, 5, 6, 8, 10])
    tokens = None
    if how == "negative length":
        lengths[6], tokens = -1, 18
    elif how == "gap between sequences":
        pointers[6:] += 2
        tokens = 21
    elif how == "first sequence not at 0":
        pointers += 2
        tokens = 21
    elif how == "document index goes back":
        doc_index[6] = 4
    elif how == "document index ends early":
        doc_index[-1] = 9
    prefix = tmp_path / "bad"
    _raw_index(prefix, lengths, pointers, doc_index, bin_tokens=tokens)
    with pytest.raises(DataError) as err:
        MegatronDataset(prefix, vocab_size=1 << 16, eod_id=0)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)
    lengths[:] = 2
    _raw_index(prefix, lengths, np.arange(10) * 4, [0, 1, 2, 3, 5, 6, 8, 10])  # the undamaged files open
    assert len(MegatronDataset(prefix, vocab_size=1 << 16, eod_id=0)) == 7


def test_an_index_written_a_slice_at_a_time_is_the_one_megatrons_builder_writes(tmp_path, monkeypatch):
    """megaframe-preprocess --layout megatron writes the index in slices (whole, its arrays cost 20
    bytes a document at the end of a run): with slices of 7 documents, across their edges, the
    .bin and .idx are byte for byte those of Megatron's IndexedDatasetBuilder."""
    from megaframe.data import megatron
    from megaframe.data.indexed import IndexedDatasetWriter

    monkeypatch.setattr(megatron, "WRITE_CHUNK", 7)
    documents = [[sequence for document in doc for sequence in document] for doc in _random_documents(1, 50, 257)]
    _megatron_build(tmp_path / "theirs", [[tokens] for tokens in documents])
    with IndexedDatasetWriter(tmp_path / "ours", dtype=np.uint16, layout="megatron") as writer:
        for tokens in documents:
            writer.add_document(np.asarray(tokens))
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes(), suffix


def test_writing_a_large_index_holds_a_slice_of_it_not_its_whole_arrays(tmp_path, monkeypatch):
    """Two million documents: the whole-array writing held 20 bytes each (40 MB here, 40 GB at two
    billion); a slice of 65,536 documents at a time holds a few MB."""
    import tracemalloc

    from megaframe.data import megatron

    monkeypatch.setattr(megatron, "WRITE_CHUNK", 1 << 16)
    offsets = np.concatenate([[0], np.cumsum(np.random.default_rng(0).integers(1, 9, 2_000_000))]).astype("<i8")
    with open(tmp_path / "big.idx", "wb") as f:
        tracemalloc.start()
        try:
            megatron.write_index(f, np.dtype(np.uint16), offsets)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 4e6, f"{peak / 1e6:.1f} MB held while writing"
    assert (tmp_path / "big.idx").stat().st_size == megatron._HEADER.size + 2_000_000 * 12 + 2_000_001 * 8


def test_a_document_longer_than_megatrons_index_records_is_refused_as_it_streams(tmp_path, monkeypatch):
    """A sequence length is an int32: a .txt of more than 2^31 - 1 tokens was refused only once the
    whole file (8 GB of text and more) had been tokenized. The limit is lowered here to 1,000 tokens."""
    from megaframe.data import megatron, preprocess
    from megaframe.data.indexed import IndexedDatasetWriter

    monkeypatch.setattr(megatron, "MAX_DOCUMENT_TOKENS", 1000)
    book = tmp_path / "book.txt"
    book.write_text("x" * (3 << 20))  # three pieces of text (long_text.PIECE_CHARS), 3 Mi byte tokens
    parts, add_part = [], IndexedDatasetWriter.add_part
    monkeypatch.setattr(IndexedDatasetWriter, "add_part", lambda self, tokens: add_part(self, parts.append(tokens)
                                                                                         or tokens))
    with pytest.raises(DataError, match="^document 1 of the inputs holds more than 1,000 tokens, more than "
                                        "Megatron's index can record for one document; split it, or write "
                                        "--format megaframe$"):
        preprocess([book], tmp_path / "ds", "byte")
    assert len(parts) == 1, "refused at its first piece"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["book.txt"]  # nothing written, no temporary file left
    parts.clear()  # held out in part (--valid-fraction): the larger part grows with it, and is refused as early
    with pytest.raises(DataError, match="^document 1 of the inputs holds more than 1,000 tokens"):
        preprocess([book], tmp_path / "ds", "byte", valid_fraction=0.1)
    assert len(parts) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["book.txt"]
    monkeypatch.setattr(megatron, "MAX_DOCUMENT_TOKENS", 2 << 20)  # halves of 1.5 Mi tokens: each fits
    preprocess([book], tmp_path / "half", "byte", valid_fraction=0.5)
    halves = (open_dataset(tmp_path / "half").num_tokens, open_dataset(tmp_path / "half_val").num_tokens)
    assert halves == ((3 << 19) + 1, (3 << 19) + 1)  # each half ends with an end-of-document token
    preprocess([book], tmp_path / "ds", "byte", layout="megaframe")  # the layout the line offers takes it
    assert open_dataset(tmp_path / "ds").num_tokens == (3 << 20) + 1  # and its end-of-document token
