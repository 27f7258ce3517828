"""Tests for the on-first-use demo dataset built from the Python standard library's sources."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from megaframe.data import ByteTokenizer, ensure_demo_dataset, open_dataset
from megaframe.data import demo as demo_module

SMALL = 150_000


def stdlib_sources() -> list[Path]:
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    return sorted((path for path in stdlib_dir.glob("*.py") if path.is_file()), key=lambda path: path.name)


def dataset_bytes(prefix: Path) -> dict[str, bytes]:
    return {suffix: Path(f"{prefix}{suffix}").read_bytes() for suffix in (".bin", ".idx", ".json")}


def test_demo_dataset_holds_stdlib_sources_in_name_order(tmp_path: Path) -> None:
    prefix = ensure_demo_dataset(tmp_path, max_bytes=SMALL)
    dataset = open_dataset(prefix)
    sources = stdlib_sources()
    eod = ByteTokenizer.eod_id
    for index in range(len(dataset)):
        assert dataset[index].tolist() == list(sources[index].read_bytes()) + [eod]
    sizes = [len(dataset[index]) - 1 for index in range(len(dataset))]
    # Stops at the first file that reaches max_bytes: all but the last file stay below it.
    assert sum(sizes) >= SMALL and sum(sizes[:-1]) < SMALL
    assert dataset.metadata["tokenizer"] == "byte" and dataset.metadata["vocab_size"] == 257
    assert dataset.metadata["source_files"] == [path.name for path in sources[: len(dataset)]]
    dataset.verify()
    assert [path.name for path in tmp_path.iterdir()] == [prefix.parent.name]


def test_demo_dataset_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = ensure_demo_dataset(tmp_path, max_bytes=SMALL)
    before = {suffix: Path(f"{prefix}{suffix}").stat().st_mtime_ns for suffix in (".bin", ".idx", ".json")}

    def fail_rebuild(*_args: object) -> None:
        raise AssertionError("demo dataset rebuilt although a cached copy exists")

    monkeypatch.setattr(demo_module, "_build", fail_rebuild)
    assert ensure_demo_dataset(tmp_path, max_bytes=SMALL) == prefix
    assert {suffix: Path(f"{prefix}{suffix}").stat().st_mtime_ns for suffix in (".bin", ".idx", ".json")} == before


def test_demo_builds_are_byte_identical_across_cache_dirs(tmp_path: Path) -> None:
    first = ensure_demo_dataset(tmp_path / "cache_a")
    second = ensure_demo_dataset(tmp_path / "cache_b")
    assert first.relative_to(tmp_path / "cache_a") == second.relative_to(tmp_path / "cache_b")
    assert dataset_bytes(first) == dataset_bytes(second)
    assert open_dataset(first).num_tokens >= 2_000_000


def test_cache_key_separates_sizes(tmp_path: Path) -> None:
    small = ensure_demo_dataset(tmp_path, max_bytes=SMALL)
    smaller = ensure_demo_dataset(tmp_path, max_bytes=SMALL // 2)
    assert small.parent != smaller.parent
    assert open_dataset(smaller).num_tokens < open_dataset(small).num_tokens


def test_losing_the_build_race_keeps_the_winners_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_build = demo_module._build
    winner_dir = tmp_path / demo_module.demo_cache_key(SMALL)

    def build_while_another_process_wins(prefix: Path, max_bytes: int) -> None:
        real_build(prefix, max_bytes)
        real_build(tmp_path / "winner" / "demo", max_bytes)
        (tmp_path / "winner" / "marker").write_text("theirs")
        (tmp_path / "winner").rename(winner_dir)

    monkeypatch.setattr(demo_module, "_build", build_while_another_process_wins)
    prefix = ensure_demo_dataset(tmp_path, max_bytes=SMALL)
    assert prefix == winner_dir / "demo"
    assert (winner_dir / "marker").read_text() == "theirs"
    assert len(open_dataset(prefix)) > 0
    assert [path.name for path in tmp_path.iterdir()] == [winner_dir.name]  # our build dir was discarded
