"""Preprocessing inputs beyond text files: parquet, datasets' save_to_disk directories; tokenizer
workers; the Megatron layout read back by Megatron's own reader."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megaframe.data import ByteTokenizer, DataError, open_dataset, preprocess
from megaframe.data.sources import find_sources

from tests.support.helpers import run_preprocess_tool as run_tool

# 301 documents: several 64-document chunks per tokenizer worker, several parquet row groups
TEXTS = [f"document {i}: " + "the cat sat on the mat " * (i % 7) + ("naïve ☕" if i % 5 == 0 else "")
         for i in range(300)] + [""]
EOD = ByteTokenizer.eod_id


def documents(prefix: Path) -> list[list[int]]:
    dataset = open_dataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.fixture
def same_text_three_ways(tmp_path: Path) -> dict[str, Path]:
    """The same documents as a .jsonl file, a .parquet file and a datasets DatasetDict directory."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)), encoding="utf-8")
    parquet = tmp_path / "corpus.parquet"
    # several row groups, so reading goes across their boundaries
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), parquet, row_group_size=70)
    hf = tmp_path / "hf"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                          "validation": datasets.Dataset.from_dict({"text": ["held out"]})}).save_to_disk(str(hf))
    return {"jsonl": jsonl, "parquet": parquet, "hf": hf}


def test_sources_are_recognised(same_text_three_ways) -> None:
    kinds = [(s.path.name, s.kind) for s in find_sources(list(same_text_three_ways.values()))]
    assert kinds == [("corpus.jsonl", "jsonl"), ("corpus.parquet", "parquet"), ("hf", "hf")]


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_parquet_and_datasets_give_the_tokens_of_the_jsonl(tmp_path, same_text_three_ways, tokenizer,
                                                           hf_tokenizer_dir) -> None:  # noqa: F811
    spec = "byte" if tokenizer == "byte" else str(hf_tokenizer_dir)
    out = {kind: tmp_path / f"out_{kind}" for kind in same_text_three_ways}
    for kind, source in same_text_three_ways.items():
        preprocess([source], out[kind], spec)
    reference = documents(out["jsonl"])
    assert len(reference) == len(TEXTS)
    if tokenizer == "byte":  # independent of the code under test: UTF-8 bytes plus end-of-document
        assert reference == [list(t.encode()) + [EOD] for t in TEXTS]
    assert documents(out["parquet"]) == reference
    assert documents(out["hf"]) == reference


def test_a_datasets_split_is_chosen_by_name(tmp_path, same_text_three_ways) -> None:
    preprocess([same_text_three_ways["hf"]], tmp_path / "valid", "byte", split="validation")
    assert documents(tmp_path / "valid") == [list(b"held out") + [EOD]]
    with pytest.raises(DataError, match=r"no split 'test' \(it has \['train', 'validation'\]\); pass --split"):
        preprocess([same_text_three_ways["hf"]], tmp_path / "x", "byte", split="test")


def test_a_missing_text_column_names_the_columns(tmp_path, same_text_three_ways) -> None:
    with pytest.raises(DataError, match=r"corpus.parquet: no 'body' column \(it has \['id', 'text'\]\); pass --json-key"):
        preprocess([same_text_three_ways["parquet"]], tmp_path / "x", "byte", json_key="body")


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_two_workers_write_the_same_files_as_one(tmp_path, same_text_three_ways, tokenizer,
                                                 hf_tokenizer_dir) -> None:  # noqa: F811
    spec = "byte" if tokenizer == "byte" else str(hf_tokenizer_dir)
    one = preprocess([same_text_three_ways["jsonl"]], tmp_path / "one", spec, workers=1)
    two = preprocess([same_text_three_ways["jsonl"]], tmp_path / "two", spec, workers=2)
    assert (one["workers"], two["workers"]) == (1, 2)
    for suffix in (".bin", ".idx"):
        assert Path(f"{tmp_path / 'one'}{suffix}").read_bytes() == Path(f"{tmp_path / 'two'}{suffix}").read_bytes()
    assert documents(tmp_path / "two") == documents(tmp_path / "one")


def test_format_megatron_is_read_back_by_megatrons_reader(tmp_path, same_text_three_ways) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronReader

    prefix = tmp_path / "meg"
    result = run_tool("--input", same_text_three_ways["jsonl"], "--output-prefix", prefix, "--format", "megatron",
                      "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "2 workers, megatron layout" in result.stdout
    theirs = MegatronReader(str(prefix), multimodal=False, mmap=True)
    assert len(theirs) == len(TEXTS)
    assert [theirs[i].tolist() for i in range(len(theirs))] == [list(t.encode()) + [EOD] for t in TEXTS]
    assert documents(prefix) == [theirs[i].tolist() for i in range(len(theirs))]


def test_format_megaframe_still_writes_the_earlier_layout(tmp_path, same_text_three_ways) -> None:
    prefix = tmp_path / "own"
    result = run_tool("--input", same_text_three_ways["jsonl"], "--output-prefix", prefix, "--format", "megaframe")
    assert result.returncode == 0, result.stderr
    assert Path(f"{prefix}.idx").read_bytes().startswith(b"MFTOKIDX")
    assert documents(prefix) == [list(t.encode()) + [EOD] for t in TEXTS]


def test_bad_workers_is_one_line(tmp_path, same_text_three_ways) -> None:
    result = run_tool("--input", same_text_three_ways["jsonl"], "--output-prefix", tmp_path / "x", "--workers", "0")
    assert result.returncode == 2 and result.stderr.strip() == "megaframe-preprocess: error: --workers 0: must be at least 1"


def test_a_lone_surrogate_in_the_json_is_one_line_naming_the_document(tmp_path) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"): Python decodes it to a str no tokenizer can
    encode, which ended the preprocessor with a UnicodeEncodeError traceback."""
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "fine"}\n{"text": "broken \\ud800 here"}\n', encoding="utf-8")
    result = run_tool("--input", source, "--output-prefix", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{source}:2" in lines[0] and "lone surrogate" in lines[0] and "character 7" in lines[0], lines[0]


def test_a_directory_is_walked_without_its_hidden_files_and_folders(tmp_path) -> None:
    """`--input .` in a project: the text files of .git/ and .venv/ are not the corpus (they were taken)."""
    for name in ("a.txt", "sub/b.jsonl", "sub/deeper/c.parquet", ".hidden.txt", ".git/notes.txt",
                 ".venv/lib/LICENSE.txt", "sub/.cache/d.jsonl", "other/readme.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    (tmp_path / "linked").symlink_to(tmp_path / "sub")  # a folder inside, linked: no second copy
    (tmp_path / "sub" / "up").symlink_to(tmp_path)  # a link back up: no loop
    found = [source.path.relative_to(tmp_path).as_posix() for source in find_sources([tmp_path])]
    assert found == ["a.txt", "sub/b.jsonl", "sub/deeper/c.parquet"]
    assert [s.path.name for s in find_sources([tmp_path / ".hidden.txt"])] == [".hidden.txt"]  # named: taken


def test_folders_linked_in_from_outside_and_upper_case_suffixes_are_taken(tmp_path) -> None:
    """Shards linked in from elsewhere and C.JSONL, D.TXT were skipped without a word (1 of 4 documents
    read, exit 0); C.JSONL named on its own was refused as an unknown extension."""
    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    for name in ("corpus/a.txt", "corpus/C.JSONL", "corpus/d.TXT", "elsewhere/part2/e.jsonl", "elsewhere/f.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    (corpus / "part2").symlink_to(elsewhere / "part2")
    (corpus / "again").symlink_to(elsewhere / "part2")  # the same shards linked twice: taken once
    found = [(s.path.relative_to(corpus).as_posix(), s.kind) for s in find_sources([corpus])]
    assert found == [("C.JSONL", "jsonl"), ("a.txt", "txt"), ("again/e.jsonl", "jsonl"), ("d.TXT", "txt")]
    assert [s.kind for s in find_sources([corpus / "C.JSONL"])] == ["jsonl"]


def test_a_fifo_input_is_named_as_one(tmp_path) -> None:
    os.mkfifo(tmp_path / "corpus.txt")
    with pytest.raises(DataError, match=r"corpus.txt: is a FIFO, not a file or a directory"):
        find_sources([tmp_path / "corpus.txt"])


def test_jsonl_lines_end_as_a_text_reader_ends_them(tmp_path) -> None:
    """.jsonl lines read as bytes (so a bad byte's file offset is known) still end at "\\n", "\\r\\n" or a
    lone "\\r", as the text reader before read them; line numbers count each."""
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "a"}\r{"text": "b"}\r\n{"text": "c"}\n\r{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"mixed\.jsonl:5: not UTF-8 text \(byte 54 of the file\)"):
        preprocess([path], tmp_path / "ds", progress=False)
    path.write_bytes(b'{"text": "a"}\r{"text": "b"}\r\n{"text": "c"}\n\r{"text": "d"}\n')
    preprocess([path], tmp_path / "ds", progress=False)
    dataset = open_dataset(tmp_path / "ds")
    assert [bytes(dataset[i].tolist()[:-1]).decode() for i in range(len(dataset))] == ["a", "b", "c", "d"]
