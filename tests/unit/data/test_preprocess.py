"""Tests for tokenizers, preprocess() and the megaframe-preprocess command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import run_preprocess_tool as run_tool
from megaframe.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    open_dataset,
    build_tokenizer,
    preprocess,
)

EOD = ByteTokenizer.eod_id


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def read_documents(prefix: Path) -> list[list[int]]:
    dataset = open_dataset(prefix)
    return [dataset[index].tolist() for index in range(len(dataset))]


@pytest.fixture
def text_inputs(tmp_path: Path) -> tuple[Path, list[str]]:
    """A directory with nested .txt files and a .jsonl file; returns it and the documents in sorted-path order."""
    corpus = tmp_path / "corpus"
    (corpus / "b_nested").mkdir(parents=True)
    (corpus / "a.txt").write_text("first document\nwith two lines\n", encoding="utf-8")
    (corpus / "b_nested" / "c.txt").write_text("naïve café ☕", encoding="utf-8")
    (corpus / "ignored.csv").write_text("not,text\n", encoding="utf-8")
    write_jsonl(corpus / "d.jsonl", [{"text": "line one", "id": 1}, {"text": ""}, {"text": "line three"}])
    documents = ["first document\nwith two lines\n", "naïve café ☕", "line one", "", "line three"]
    return corpus, documents


def trained_vocabulary(tokenizer_dir: Path) -> dict[str, int]:
    """Word -> id mapping straight from the saved tokenizer.json, independent of the code under test."""
    return json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]


def test_byte_tokenizer_round_trip() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo ☕")
    assert ids == list("héllo ☕".encode("utf-8"))
    assert tokenizer.decode(ids + [EOD]) == "héllo ☕"
    assert tokenizer.decode([0xFF]) == "\ufffd"
    assert (tokenizer.vocab_size, tokenizer.eod_id, tokenizer.name) == (257, 256, "byte")


def test_build_tokenizer(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    hf = build_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(hf, HFTokenizer)
    assert hf.name == str(hf_tokenizer_dir)
    vocab = trained_vocabulary(hf_tokenizer_dir)
    assert (hf.vocab_size, hf.eod_id) == (len(vocab), vocab["</s>"])
    assert hf.decode(hf.encode("the cat sat") + [hf.eod_id]) == "the cat sat"
    with pytest.raises(DataError, match="not 'byte' and not a local directory"):
        build_tokenizer("gpt2")
    empty_dir = tmp_path / "not_a_tokenizer"
    empty_dir.mkdir()
    with pytest.raises(DataError, match="cannot load a tokenizer") as error:
        build_tokenizer(str(empty_dir))
    assert "\n" not in str(error.value)


def test_hf_tokenizer_without_eos_is_rejected(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    config_path = hf_tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("eos_token", None)
    config_path.write_text(json.dumps(config))
    with pytest.raises(DataError, match="no eos_token"):
        HFTokenizer(hf_tokenizer_dir)


def test_tool_round_trip_txt_and_jsonl(tmp_path: Path, text_inputs: tuple[Path, list[str]]) -> None:
    corpus, documents = text_inputs
    prefix = tmp_path / "out" / "ds"
    result = run_tool("--input", corpus, "--output-prefix", prefix)
    assert result.returncode == 0, result.stderr
    assert "5 documents" in result.stdout and len(result.stdout.strip().splitlines()) == 1
    assert read_documents(prefix) == [list(text.encode("utf-8")) + [EOD] for text in documents]
    metadata = open_dataset(prefix).metadata
    assert (metadata["tokenizer"], metadata["vocab_size"], metadata["eod_id"]) == ("byte", 257, 256)


def test_tool_explicit_files_keep_argument_order_and_json_key(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "records.jsonl", [{"body": "alpha"}, {"body": "beta"}])
    text = tmp_path / "note.txt"
    text.write_text("gamma", encoding="utf-8")
    prefix = tmp_path / "ds"
    result = run_tool("--input", jsonl, text, "--output-prefix", prefix, "--json-key", "body", "--no-append-eod")
    assert result.returncode == 0, result.stderr
    assert read_documents(prefix) == [list(b"alpha"), list(b"beta"), list(b"gamma")]


def test_tool_with_local_hf_tokenizer(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    texts = ["the cat sat", "a dog ran on the mat", "unknown words here"]
    jsonl = write_jsonl(tmp_path / "data.jsonl", [{"text": text} for text in texts])
    prefix = tmp_path / "hf_ds"
    result = run_tool("--input", jsonl, "--output-prefix", prefix, "--tokenizer", hf_tokenizer_dir)
    assert result.returncode == 0, result.stderr
    tokenizer = HFTokenizer(hf_tokenizer_dir)
    documents = read_documents(prefix)
    assert documents == [tokenizer.encode(text) + [tokenizer.eod_id] for text in texts]
    vocab = trained_vocabulary(hf_tokenizer_dir)
    assert documents[0] == [vocab["the"], vocab["cat"], vocab["sat"], vocab["</s>"]]
    assert documents[2] == [vocab["[UNK]"]] * 3 + [vocab["</s>"]]
    metadata = open_dataset(prefix).metadata
    assert metadata["tokenizer"] == str(hf_tokenizer_dir)
    assert (metadata["vocab_size"], metadata["eod_id"]) == (len(vocab), vocab["</s>"])


@pytest.mark.parametrize(
    "make_args, expected",
    [
        (lambda tmp: ["--input", tmp / "missing.txt"], "no such file or directory"),
        (lambda tmp: ["--input", tmp / "data.csv"], "unknown extension '.csv'"),
        (lambda tmp: ["--input", tmp / "no_key.jsonl"],
         "no_key.jsonl:2: no 'text' field (it has 'body'); pass --json-key"),
        (lambda tmp: ["--input", tmp / "list.jsonl"], "list.jsonl:1: a JSON list, not an object; each line must be"),
        # a byte that is not UTF-8 on line 3, past what a text reader decodes at once: named by line and file offset
        (lambda tmp: ["--input", tmp / "late.jsonl"], "late.jsonl:3: not UTF-8 text (byte 20036 of the file)"),
        (lambda tmp: ["--input", tmp / "bad.jsonl"], "bad.jsonl:1: invalid JSON"),
        (lambda tmp: ["--input", tmp / "blank.jsonl"], "produced no tokens"),
        # an empty .txt was "1 documents, 1 tokens" (its end-of-document token), refused only by training
        (lambda tmp: ["--input", tmp / "empty.txt"], "empty.txt: produced no tokens of text (1 documents, all empty)"),
        (lambda tmp: ["--input", tmp / "empty_dir"], "holds no .txt/.jsonl/.parquet files"),
        (lambda tmp: ["--input", tmp / "data.csv", "--tokenizer", "gpt2"], "--tokenizer gpt2: not 'byte'"),
    ],
)
def test_tool_bad_input_exits_2_with_one_line(tmp_path: Path, make_args, expected: str) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    write_jsonl(tmp_path / "no_key.jsonl", [{"text": "ok"}, {"body": "missing"}])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    long_line = b'{"text": "' + b"a" * 10000 + b'"}\n'  # 10,013 bytes
    (tmp_path / "late.jsonl").write_bytes(long_line * 2 + b'{"text": "\xff"}\n')
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty_dir").mkdir()
    result = run_tool(*make_args(tmp_path), "--output-prefix", tmp_path / "out" / "ds")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("megaframe-preprocess: error: ")
    assert expected in lines[0]
    assert not (tmp_path / "out" / "ds.json").exists()


def test_failed_preprocess_keeps_previous_dataset(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text("keep me", encoding="utf-8")
    prefix = tmp_path / "ds"
    summary = preprocess([good], prefix, ByteTokenizer())
    assert (summary["num_documents"], summary["num_tokens"]) == (1, 8)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"other": 1}])
    with pytest.raises(DataError, match="bad.jsonl:2"):
        preprocess([good, bad], prefix, "byte")
    assert read_documents(prefix) == [list(b"keep me") + [EOD]]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.jsonl", "ds.bin", "ds.idx", "ds.json", "good.txt"]


def test_help_runs() -> None:
    result = run_tool("--help")
    assert result.returncode == 0
    assert "--output-prefix" in result.stdout and "--json-key" in result.stdout


@pytest.mark.parametrize("prefix", ["newdata/", ".", "..", "newdata/.."])
def test_an_output_prefix_naming_a_folder_is_one_line(tmp_path: Path, prefix: str, capsys, monkeypatch) -> None:
    """--output-prefix newdata/ wrote newdata.bin beside the folder, and data.path=newdata/ then found
    nothing; --output-prefix . wrote ..bin."""
    from megaframe.data.preprocess_cli import main

    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    monkeypatch.chdir(tmp_path)
    assert main(["--input", "a.jsonl", "--output-prefix", prefix]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"megaframe-preprocess: error: --output-prefix {prefix} names a folder"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]
