"""A damaged Hugging Face `datasets` directory (save_to_disk's output) given to megaframe-preprocess
is one line naming the input and exit code 2 (issue 50): an overwritten or truncated .arrow shard, a
missing shard, a broken state.json, dataset_info.json or dataset_dict.json were tracebacks of
pyarrow's ArrowInvalid, json's JSONDecodeError, or an OSError naming neither the input nor the fix."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megaframe.data.preprocess_cli import main

ROWS = [f"document {i}: the cat sat on the mat" for i in range(300)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One Dataset and one DatasetDict, written once by save_to_disk (copied per case)."""
    import datasets

    root = tmp_path_factory.mktemp("saved")
    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(str(root / "dataset"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ROWS})}).save_to_disk(str(root / "dict"))
    return {"dataset": root / "dataset", "dict": root / "dict"}


def _shard(directory: Path) -> Path:
    return next(directory.rglob("*.arrow"))


def _overwrite_head(directory: Path) -> None:
    shard = _shard(directory)
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)
    shard.write_bytes(bytes(data))


def _truncate(directory: Path) -> None:
    shard = _shard(directory)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


DAMAGE = {
    "shard-overwritten": ("dataset", _overwrite_head),
    "shard-truncated": ("dataset", _truncate),
    "shard-missing": ("dataset", lambda d: _shard(d).unlink()),
    "state-json-broken": ("dataset", lambda d: (d / "state.json").write_text("{not json")),
    "info-json-broken": ("dataset", lambda d: (d / "dataset_info.json").write_text("[1, 2")),
    "dict-json-broken": ("dict", lambda d: (d / "dataset_dict.json").write_text('{"splits": ')),
    "dict-split-shard-truncated": ("dict", _truncate),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_datasets_directory_is_one_line_naming_it(case, saved, tmp_path, capsys):
    kind, damage = DAMAGE[case]
    directory = tmp_path / "corpus"
    shutil.copytree(saved[kind], directory)
    damage(directory)
    prefix = tmp_path / "out"
    code = main(["--input", str(directory), "--output-prefix", str(prefix)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megaframe-preprocess: error: --input {directory}: damaged"), lines[0]
    assert "Traceback" not in lines[0] and not list(tmp_path.glob("out*")), lines[0]


def test_the_undamaged_copy_still_reads(saved, tmp_path, capsys):
    """The same directories, undamaged: every row becomes a document (what the cases above break)."""
    for kind in ("dataset", "dict"):
        assert main(["--input", str(saved[kind]), "--output-prefix", str(tmp_path / kind)]) == 0
        assert f"{len(ROWS)} documents" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--input", ""], ["--input", "notes.txt", " "], ["--output-prefix", ""],
                                   ["--output-prefix", " "], ["--tokenizer", ""], ["--json-key", ""],
                                   ["--split", " "]])
def test_an_empty_argument_is_one_line_naming_the_flag(flags, tmp_path, monkeypatch, capsys):
    """An unset shell variable: an empty --input walked the current directory, an empty --output-prefix
    wrote hidden .bin/.idx/.json files there, an empty --split read the train split."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("private notes in the current directory")
    args = {"--input": ["notes.txt"], "--output-prefix": ["out"]}
    args[flags[0]] = flags[1:]
    code = main([item for flag, values in args.items() for item in (flag, *values)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"megaframe-preprocess: error: {flags[0]} is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written
