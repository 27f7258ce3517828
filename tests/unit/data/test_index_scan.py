"""The pre-launch check's walks over whole index files serve the next open of the same files in the
process (data/index_scan.py): an srun or torchrun task checked the data, then opened it again to
train, walking every index entry twice (100 GB of .idx for a blend of 5 billion documents)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from megaframe.data import open_dataset
from megaframe.data import index_scan, indexed, megatron
from megaframe.data.index_scan import walks_remembered
from tests.unit.data.test_indexed import DOCUMENTS, write_dataset


@pytest.fixture
def walks(monkeypatch) -> list[str]:
    """The walks made, by reader: Megatron's sequences and document index, megaframe's offsets."""
    made: list[str] = []
    for module, name in ((megatron, "scan_sequences"), (megatron, "nondecreasing"), (indexed, "nondecreasing")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name: made.append(_n) or _o(*a))
    monkeypatch.setattr(index_scan, "_WALKED", {})
    return made


@pytest.mark.parametrize("layout", ["megatron", "megaframe"])
def test_the_checks_walks_serve_the_next_open_once(tmp_path: Path, walks, layout) -> None:
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout=layout)
    open_dataset(prefix)
    per_open = len(walks)
    assert per_open >= 1
    with walks_remembered():  # the pre-launch check
        open_dataset(prefix)
    assert len(walks) == 2 * per_open
    open_dataset(prefix)  # the trainer: nothing walked again
    assert len(walks) == 2 * per_open
    open_dataset(prefix)  # used once: a later open walks
    assert len(walks) == 3 * per_open


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
def test_a_file_changed_after_the_check_is_walked_again(tmp_path: Path, walks, suffix) -> None:
    """Another modification time (any rewrite) or size is another file: walked again, not served."""
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout="megatron")
    with walks_remembered():
        open_dataset(prefix)
    walked = len(walks)
    path = Path(f"{prefix}{suffix}")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    open_dataset(prefix)
    assert "scan_sequences" in walks[walked:]


def test_the_pre_launch_check_leaves_its_walks_to_the_trainer(tmp_path: Path, walks) -> None:
    from megaframe.config.compose import compose
    from megaframe.launch.checks import dataset_problem
    from megaframe.training.data_setup import build_data

    prefix = write_dataset(tmp_path / "ds", [list(range(1, 200)) + [256]] * 8)
    cfg, _ = compose([f"data.path={prefix}", "model.seq_length=16"])
    assert dataset_problem(cfg) is None
    walked = len(walks)
    build_data(cfg.data, cfg.model.seq_length)
    assert walked and len(walks) == walked


def test_a_file_rewritten_with_its_old_modification_time_is_walked_again(tmp_path: Path, walks) -> None:
    """cp -p and rsync -t keep the modification time of what they overwrite; the change time moves."""
    prefix = write_dataset(tmp_path / "ds", DOCUMENTS, layout="megatron")
    idx = Path(f"{prefix}.idx")
    before = idx.stat()
    with walks_remembered():
        open_dataset(prefix)
    walked = len(walks)
    idx.write_bytes(idx.read_bytes())
    os.utime(idx, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert idx.stat().st_mtime_ns == before.st_mtime_ns and idx.stat().st_size == before.st_size
    open_dataset(prefix)
    assert "scan_sequences" in walks[walked:]
