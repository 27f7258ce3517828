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


def _save_with_native_files(rank: int, world: int, save_dir: str) -> list[str]:
    from megaframe.checkpoint import store, universal

    class Engine:  # writes what DeepSpeed's save_checkpoint writes per rank: its optimizer states
        def save_native(self, directory, tag, client_state) -> None:
            folder = Path(directory) / tag
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(bytes([rank + 1]) * (1 << 20))

    hashed: list[str] = []
    real = universal.file_entry

    def counted(path):
        hashed.append(Path(path).name)
        return real(path)

    universal.file_entry = counted
    store.save(Engine(), Path(save_dir), 3, {"step": 3}, native=True)
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
