"""A checkpoint with the engine's own files (train.native_checkpoint, or ZeRO-0 bf16 at pp=1): each
rank hashes its share of them for the manifest. Rank 0 hashed them all (DeepSpeed names no paths):
about 16 bytes a parameter of optimizer states, 1.1 TB at 70B, while every other rank waited on it."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow


class _Engine:
    """Writes what DeepSpeed's save_checkpoint writes per rank: its optimizer states."""

    def __init__(self, rank: int):
        self.rank = rank

    def save_native(self, directory, tag, client_state) -> None:
        folder = Path(directory) / tag
        folder.mkdir(parents=True, exist_ok=True)
        states = folder / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt"
        states.write_bytes(bytes([self.rank + 1]) * (1 << 20))


def _save_with_native_files(rank: int, world: int, save_dir: str) -> list[str]:
    from megaframe.checkpoint import store, universal

    hashed: list[str] = []
    real = universal.file_entry

    def counted(path):
        hashed.append(Path(path).name)
        return real(path)

    universal.file_entry = counted
    store.save(_Engine(rank), Path(save_dir), 3, {"step": 3}, native=True)
    return hashed


def test_each_rank_hashes_its_share_of_the_engines_files(tmp_path):
    results = run_ranks(_save_with_native_files, 2, tmp_path, save_dir=str(tmp_path / "checkpoints"))
    native = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    for rank, hashed in enumerate(results):
        assert [name for name in hashed if name in native] == [native[rank]], (rank, hashed)
    final = tmp_path / "checkpoints" / "global_step3"
    manifest = json.loads((final / "manifest.json").read_text())["files"]
    for name in native:  # the manifest holds what is on disk, as an independent hash says
        assert manifest[name]["sha256"] == hashlib.sha256((final / name).read_bytes()).hexdigest()


def _save_in_the_background(rank: int, world: int, save_dir: str) -> list[str]:
    import threading

    from megaframe.checkpoint import store, universal

    threads: list[str] = []
    real = universal.file_entry

    def counted(path):
        if "optim_states" in Path(path).name:
            threads.append("main" if threading.current_thread() is threading.main_thread() else "writer")
        return real(path)

    universal.file_entry = counted
    writer = store.BackgroundWriter()
    store.save(_Engine(rank), Path(save_dir), 3, {"step": 3}, native=True, background=writer)
    writer.wait()
    return threads


def test_under_async_save_the_engines_files_are_hashed_on_the_writer_thread(tmp_path):
    """train.async_save: the step loop goes on while a save is written and hashed. The engine's own
    files were hashed in the step loop (seconds a save at scale: gigabytes per rank); now on each
    rank's writer thread, each rank its share, and the manifest still verifies."""
    results = run_ranks(_save_in_the_background, 2, tmp_path, save_dir=str(tmp_path / "checkpoints"))
    assert results == [["writer"], ["writer"]], results
    from megaframe.checkpoint import universal

    final = tmp_path / "checkpoints" / "global_step3"
    universal.verify_files(final, universal.read_manifest(final)["files"])
