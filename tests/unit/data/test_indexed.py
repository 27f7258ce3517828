"""Tests for the memory-mapped indexed dataset layouts (Megatron's, the default, and megaframe's MFTOKIDX)
and their atomic writer."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from megaframe.data import DataError, IndexedDatasetWriter, best_dtype, open_dataset
from megaframe.data.indexed import LAYOUTS

BYTE_METADATA = {"tokenizer": "byte", "vocab_size": 257, "eod_id": 256}
DOCUMENTS = [[1, 2, 3, 256], [], [255, 256], list(range(100)) + [256]]


@pytest.fixture(params=LAYOUTS)
def layout(request) -> str:
    return request.param


def write_dataset(prefix: Path, documents: list, metadata: dict | None = None, dtype=np.uint16,
                  layout: str = LAYOUTS[0]) -> Path:
    """Write `documents` with IndexedDatasetWriter and return the prefix."""
    with IndexedDatasetWriter(prefix, dtype=dtype, layout=layout) as writer:
        for document in documents:
            writer.add_document(document)
        writer.finalize(dict(metadata or BYTE_METADATA))
    return prefix


def final_paths(prefix: Path) -> list[Path]:
    return [Path(f"{prefix}{suffix}") for suffix in (".bin", ".idx", ".json")]


def assert_one_line(error: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path: Path, dtype, layout: str) -> None:
    prefix = write_dataset(tmp_path / "sub" / "ds", DOCUMENTS, dtype=dtype, layout=layout)
    dataset = open_dataset(prefix)
    assert len(dataset) == len(DOCUMENTS)
    for index, document in enumerate(DOCUMENTS):
        assert dataset[index].tolist() == document
    assert dataset[-1].tolist() == DOCUMENTS[-1]
    assert dataset.tokens.tolist() == [token for document in DOCUMENTS for token in document]
    assert dataset.doc_offsets.tolist() == [0, 4, 4, 6, 107]
    assert dataset.tokens.dtype == np.dtype(dtype)
    assert dataset.num_tokens == 107
    assert dataset.vocab_size == 257 and dataset.eod_id == 256
    with pytest.raises(IndexError):
        dataset[len(DOCUMENTS)]
    dataset.verify()


def test_default_layout_is_megatrons_and_megatron_reads_it(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronReader

    prefix = write_dataset(tmp_path / "ds", DOCUMENTS)
    assert Path(f"{prefix}.idx").read_bytes().startswith(b"MMIDIDX\x00\x00")
    reader = MegatronReader(str(prefix), multimodal=False, mmap=True)
    assert len(reader) == len(DOCUMENTS)
    assert [reader[i].tolist() for i in range(len(reader))] == DOCUMENTS
    assert reader.document_indices.tolist() == list(range(len(DOCUMENTS) + 1))


def test_metadata_written_and_extended(tmp_path: Path, layout: str) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, {**BYTE_METADATA, "source": "unit-test"}, layout=layout)
    metadata = json.loads((tmp_path / "ds.json").read_text())
    assert metadata["tokenizer"] == "byte"
    assert metadata["vocab_size"] == 257
    assert metadata["eod_id"] == 256
    assert metadata["num_documents"] == 4
    assert metadata["num_tokens"] == 107
    assert metadata["source"] == "unit-test"
    assert open_dataset(prefix).metadata == metadata


def test_memmap_is_read_only(tmp_path: Path, layout: str) -> None:
    dataset = open_dataset(write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout))
    with pytest.raises(ValueError):
        dataset.tokens[0] = 7


def test_pickle_reopens_by_prefix(tmp_path: Path, layout: str) -> None:
    dataset = open_dataset(write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout))
    restored = pickle.loads(pickle.dumps(dataset))
    assert restored.prefix == dataset.prefix
    assert np.array_equal(restored.tokens, dataset.tokens)


def test_best_dtype() -> None:
    assert best_dtype(257) == np.uint16
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65536) == np.uint16
    assert best_dtype(65537) == np.int32
    assert best_dtype(256_000) == np.int32
    with pytest.raises(DataError):
        best_dtype(0)


@pytest.mark.parametrize("bad_document", [[70_000], [-1], [1.5], [[1, 2]]])
def test_writer_rejects_tokens_that_do_not_fit(tmp_path: Path, bad_document, layout: str) -> None:
    with IndexedDatasetWriter(tmp_path / "ds", layout=layout) as writer:
        with pytest.raises(DataError) as error:
            writer.add_document(bad_document)
    assert_one_line(error)


def test_finalize_requires_tokenizer_metadata(tmp_path: Path, layout: str) -> None:
    with IndexedDatasetWriter(tmp_path / "ds", layout=layout) as writer:
        writer.add_document([1, 2])
        with pytest.raises(DataError, match="vocab_size"):
            writer.finalize({"tokenizer": "byte", "eod_id": 256})
        assert not any(path.exists() for path in final_paths(tmp_path / "ds"))
        writer.finalize(BYTE_METADATA)  # the mistake is recoverable: nothing was discarded
    assert open_dataset(tmp_path / "ds")[0].tolist() == [1, 2]


def test_finalize_rejects_tokens_beyond_vocab(tmp_path: Path, layout: str) -> None:
    with IndexedDatasetWriter(tmp_path / "ds", layout=layout) as writer:
        writer.add_document([300])
        with pytest.raises(DataError, match="vocab_size=257"):
            writer.finalize(BYTE_METADATA)


def test_interrupted_writer_leaves_no_final_files(tmp_path: Path, layout: str) -> None:
    prefix = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(prefix, layout=layout) as writer:
            writer.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert not any(path.exists() for path in final_paths(prefix))
    assert list(tmp_path.iterdir()) == []


def test_crash_before_finalize_keeps_previous_copy(tmp_path: Path, layout: str) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    before = {path: path.read_bytes() for path in final_paths(prefix)}
    # No context manager and no finalize: what a killed process leaves behind.
    writer = IndexedDatasetWriter(prefix, layout=layout)
    writer.add_document([9, 9, 9])
    writer._bin_file.flush()
    assert {path: path.read_bytes() for path in final_paths(prefix)} == before
    assert open_dataset(prefix)[0].tolist() == DOCUMENTS[0]
    writer.abort()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ds.bin", "ds.idx", "ds.json"]


def test_crash_midway_through_commit_never_looks_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       layout: str) -> None:
    # Same sizes as the old copy, so only the commit order can keep the new .bin from passing as the old dataset.
    prefix = write_dataset(tmp_path / "ds", [[1, 2, 3]], layout=layout)
    real_replace = os.replace
    replaced: list[str] = []

    def replace_then_crash(source: str, destination: str | Path) -> None:
        if str(destination).endswith(".idx"):
            raise OSError("simulated crash between renames")
        replaced.append(str(destination))
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace_then_crash)
    with pytest.raises(OSError, match="simulated"):
        write_dataset(prefix, [[7, 8, 9]], layout=layout)
    assert replaced == [f"{prefix}.bin"]
    with pytest.raises(DataError, match=r"ds\.json (not found|sidecar)"):
        open_dataset(prefix)


def test_finalize_replaces_previous_copy(tmp_path: Path, layout: str) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    write_dataset(prefix, [[5, 6]], layout=layout)
    dataset = open_dataset(prefix)
    assert len(dataset) == 1 and dataset[0].tolist() == [5, 6]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ds.bin", "ds.idx", "ds.json"]


def test_writer_is_single_use(tmp_path: Path, layout: str) -> None:
    writer = IndexedDatasetWriter(tmp_path / "ds", layout=layout)
    writer.add_document([1])
    writer.finalize(BYTE_METADATA)
    with pytest.raises(DataError):
        writer.add_document([2])
    with pytest.raises(DataError):
        IndexedDatasetWriter(tmp_path / "empty", layout=layout).finalize(BYTE_METADATA)


@pytest.mark.parametrize("suffix", [".idx", ".bin", ".json"])
def test_missing_file_is_reported(tmp_path: Path, suffix: str, layout: str) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    Path(f"{prefix}{suffix}").unlink()
    with pytest.raises(DataError) as error:
        open_dataset(prefix)
    if layout == "megatron" and suffix == ".json":  # as Megatron writes it: the tokenizer must be named
        assert f"there is no {prefix}.json sidecar; set data.tokenizer" in str(error.value)
    else:
        assert f"data.path={prefix}: {prefix}{suffix} not found" in str(error.value)
        assert "megaframe-preprocess" in str(error.value)
    assert_one_line(error)


def test_truncated_bin_is_detected(tmp_path: Path, layout: str) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    bin_path = Path(f"{prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DataError, match="truncated") as error:
        open_dataset(prefix)
    assert_one_line(error)


def test_corrupted_bin_fails_verify(tmp_path: Path, layout: str) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    bin_path = Path(f"{prefix}.bin")
    corrupted = bytearray(bin_path.read_bytes())
    corrupted[10] ^= 0xFF
    bin_path.write_bytes(bytes(corrupted))
    dataset = open_dataset(prefix)  # same size: only the checksum can tell
    with pytest.raises(DataError, match="checksum"):
        dataset.verify()


VERSION_FIELD = {"megatron": (9, 8), "megaframe": (8, 4)}  # (offset, size) of the index's version


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data, layout: b"XXXXXXXX" + data[8:], "magic"),
        (lambda data, layout: data[:-8], "truncated"),
        (lambda data, layout: data[:20], "truncated"),
        (lambda data, layout: data[:VERSION_FIELD[layout][0]] + (99).to_bytes(VERSION_FIELD[layout][1], "little")
         + data[sum(VERSION_FIELD[layout]):], "version"),
    ],
)
def test_corrupt_idx_is_detected(tmp_path: Path, damage, message: str, layout: str) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    idx_path = Path(f"{prefix}.idx")
    idx_path.write_bytes(damage(idx_path.read_bytes(), layout))
    with pytest.raises(DataError, match=message):
        open_dataset(prefix)


def test_json_from_another_build_is_detected(tmp_path: Path, layout: str) -> None:
    first = write_dataset(tmp_path / "first", DOCUMENTS, layout=layout)
    second = write_dataset(tmp_path / "second", [[7] * 107], layout=layout)
    Path(f"{first}.json").write_bytes(Path(f"{second}.json").read_bytes())
    with pytest.raises(DataError, match="different build"):
        open_dataset(first)


@pytest.mark.parametrize("field, value, fragment", [
    ("vocab_size", "300", "its vocab_size is '300', not a whole number >= 1"),
    ("vocab_size", True, "its vocab_size is True"),
    ("eod_id", 9999, "its eod_id is 9999, not a token id below vocab_size=257"),
    ("checksum", "not-hex!", "its checksum is 'not-hex!', not hexadecimal"),
    ("tokenizer_sha256", "zz", "its tokenizer_sha256 is 'zz', not hexadecimal"),
    ("tokenizer_sha256", "ab" * 32, "its tokenizer_hash_scheme is None, not one of [1, 2]"),
    ("tokenizer", 5, "its tokenizer is 5, not a name or a directory"),
    ("num_tokens", -1, "its num_tokens is -1"),
])
def test_a_damaged_sidecar_field_is_one_line_naming_it(tmp_path: Path, layout: str, field, value, fragment) -> None:
    """Hand-edited or damaged sidecars used to end in a ValueError traceback (or be read as another value)."""
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    sidecar = Path(f"{prefix}.json")
    fields = json.loads(sidecar.read_text())
    fields[field] = value
    sidecar.write_text(json.dumps(fields))
    with pytest.raises(DataError) as error:
        open_dataset(prefix)
    assert fragment in str(error.value) and f"data.path={prefix}" in str(error.value), str(error.value)
    assert_one_line(error)


@pytest.mark.parametrize("edits, fragment", [
    ({"vocab_size": 100000}, "it names the byte tokenizer but records vocab_size=100000, eod_id=256"),
    ({"eod_id": 32}, "it names the byte tokenizer but records vocab_size=257, eod_id=32"),
    ({"tokenizer": "tok", "vocab_size": 100000}, "its vocab_size is 100000, more ids than its uint16 tokens can hold"),
    ({"tokenizer": "tok", "vocab_size": 10**12}, "its vocab_size is 1000000000000, more ids than its uint16"),
])
def test_a_vocabulary_the_tokens_or_the_tokenizer_contradict_is_refused(tmp_path: Path, layout: str, edits,
                                                                        fragment) -> None:
    """vocab_size edited from 257 to 100000 built a model of 100,000 rows and trained it, exit 0; eod_id
    edited to 32 cut documents at every space under data.document_mask; 10^12 was blamed on the planner."""
    from megaframe.config.dataset_meta import SidecarError, recorded_vocab_size

    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    sidecar = Path(f"{prefix}.json")
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), **edits}))
    with pytest.raises(DataError) as error:
        open_dataset(prefix)
    assert fragment in str(error.value), str(error.value)
    assert_one_line(error)
    if "byte" in fragment or 10**12 in edits.values():  # before launch, as validation and the planner read it
        with pytest.raises(SidecarError, match=fragment.split(", more")[0].replace("(", r"\(")):
            recorded_vocab_size(str(prefix))


def test_data_tokenizer_must_be_the_one_the_sidecar_records(tmp_path: Path, layout: str, hf_tokenizer_dir) -> None:
    """Another data.tokenizer used to be ignored for training but written into every checkpoint and
    shipped by megaframe-convert to-hf."""
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)  # made by the byte tokenizer
    assert open_dataset(prefix, "byte").vocab_size == 257
    with pytest.raises(DataError) as error:
        open_dataset(prefix, str(hf_tokenizer_dir))
    assert f"data.tokenizer={hf_tokenizer_dir}, but {prefix}.json records" in str(error.value)
    assert "set data.tokenizer=byte" in str(error.value)
    assert_one_line(error)


def _files(prefix: Path) -> list[bytes]:
    return [path.read_bytes() for path in final_paths(prefix)]


def test_a_document_written_in_parts_is_the_document_written_whole(tmp_path: Path, layout: str) -> None:
    """add_part ... end_document (a .txt's pieces streamed) writes the bytes and checksum add_document does."""
    write_dataset(tmp_path / "whole", DOCUMENTS, layout=layout)
    with IndexedDatasetWriter(tmp_path / "parts", layout=layout) as writer:
        for document in DOCUMENTS:
            for start in range(0, len(document), 7):
                writer.add_part(document[start:start + 7])
            writer.end_document()
        writer.finalize(dict(BYTE_METADATA))
    assert _files(tmp_path / "parts")[:2] == _files(tmp_path / "whole")[:2]
    assert json.loads(_files(tmp_path / "parts")[2]) == json.loads(_files(tmp_path / "whole")[2])
    open_dataset(tmp_path / "parts").verify()


@pytest.mark.parametrize("keep", [0, 5, 33, 100])
def test_an_open_document_read_back_and_truncated_is_its_kept_part_written_whole(tmp_path: Path, layout: str,
                                                                                  keep: int) -> None:
    """What the held-out split of one long document does: read its tail back from the temp file, keep
    its head; the files and checksum are those of the kept head written whole."""
    document = [(7 * i) % 256 for i in range(100)]
    write_dataset(tmp_path / "whole", [[1, 2], document[:keep] + [256]], layout=layout)
    with IndexedDatasetWriter(tmp_path / "cut", layout=layout) as writer:
        writer.add_document([1, 2])
        for start in range(0, 100, 30):
            writer.add_part(document[start:start + 30])
        tail = np.concatenate([np.empty(0, np.uint16), *writer.open_document_tokens(keep, chunk_tokens=16)])
        assert tail.tolist() == document[keep:] and writer.open_tokens == 100
        writer.truncate_open_document(keep)
        writer.add_part([256])
        writer.end_document()
        writer.finalize(dict(BYTE_METADATA))
    assert json.loads(_files(tmp_path / "cut")[2]) == json.loads(_files(tmp_path / "whole")[2])
    assert _files(tmp_path / "cut")[:2] == _files(tmp_path / "whole")[:2]
    open_dataset(tmp_path / "cut").verify()


def test_a_refused_first_part_begins_no_document(tmp_path: Path) -> None:
    """A part whose ids do not fit is refused and leaves the writer as it was (it was left 'open')."""
    write_dataset(tmp_path / "direct", [[1]])
    with IndexedDatasetWriter(tmp_path / "ds") as writer:
        with pytest.raises(DataError, match="token id -1 does not fit"):
            writer.add_part([-1])
        writer.add_document([1])
        writer.finalize(dict(BYTE_METADATA))
    assert _files(tmp_path / "ds")[:2] == _files(tmp_path / "direct")[:2]


def test_a_document_left_open_is_refused(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "ds") as writer:
        writer.add_part([1, 2])
        with pytest.raises(DataError, match="is open; call end_document"):
            writer.add_document([3])
        with pytest.raises(DataError, match="cannot keep 3 of the open document's 2 tokens"):
            writer.truncate_open_document(3)
        with pytest.raises(DataError, match="was not ended; call end_document"):
            writer.finalize(dict(BYTE_METADATA))
    assert not list(tmp_path.iterdir())
