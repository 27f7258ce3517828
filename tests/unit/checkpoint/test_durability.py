"""A published checkpoint is durable, not only atomic: every file a save writes is fsync'd, and so
is each directory before it is renamed and save_dir after the rename, before `latest` moves (on
Lustre/NFS a node lost seconds after a save would otherwise leave `latest` naming lost data).

os.fsync is recorded during a real single-rank save (shards, RNG file, state.json, a tokenizer
copy, the engine's own file, index and manifest), each fd resolved to its path through /proc and
to its inode (a file written under a temporary name and renamed is the inode that was fsync'd)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint import store as checkpoint
from megaframe.checkpoint.boxes import Box
from megaframe.checkpoint.fast_tier import FastTier

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="resolves fds through /proc")

WEIGHTS = {"embed.weight": torch.randn(6, 4), "blocks.0.mlp.weight": torch.randn(4, 4)}
STATE = {"step": 4, "consumed_samples": 32, "model": {}, "version": universal.SHARDED_VERSION}


class UnsyncedEngine:
    """An engine whose own save writes a file without fsync, as DeepSpeed's does."""

    def save_native(self, save_dir, tag, client_state):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_text(str(client_state["step"]))


class Fsyncs(list):
    """The real path of each fd os.fsync was called on, in call order; inodes: {inode: the
    positions in that order where it was fsync'd}."""

    def __init__(self):
        super().__init__()
        self.inodes: dict[tuple[int, int], list[int]] = {}


def _inode(path: Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def _record_fsyncs(monkeypatch) -> Fsyncs:
    """Replace os.fsync with one that logs what each fd names."""
    calls = Fsyncs()
    real = os.fsync

    def fsync(fd):
        stat = os.fstat(fd)
        calls.inodes.setdefault((stat.st_dev, stat.st_ino), []).append(len(calls))
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    def sync_filesystem(path):
        """syncfs flushes the node's writes to the file system: here, everything under `path` now."""
        for entry in [Path(path), *sorted(Path(path).rglob("*"))]:
            fd = os.open(entry, os.O_RDONLY)
            try:
                fsync(fd)
            finally:
                os.close(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpoint, "sync_filesystem", sync_filesystem)
    return calls


def _tokenizer(tmp_path: Path) -> Path:
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_text('{"model": {}}')
    (directory / "tokenizer_config.json").write_text("{}")
    return directory


def _write_part(tokenizer_dir: Path):
    """write_extra of a real rank-0 save: the layout-free shard, state.json and the tokenizer copy,
    deferred as an async save defers them."""
    pieces = [sharded.Piece(key, tuple(value.shape), Box((0,) * value.dim(), tuple(value.shape)),
                            lambda value=value: value) for key, value in WEIGHTS.items()]
    return lambda directory: sharded.rank_writer(directory, 0, pieces, STATE, tokenizer_dir)


def _published(path: str, save_dir: Path) -> str:
    """The path a file fsync'd under tmp-global_stepN has once the directory is renamed."""
    return re.sub(rf"^{re.escape(str(save_dir))}/tmp-(global_step\d+)", rf"{save_dir}/\1", path)


def _assert_durable(calls: Fsyncs, save_dir: Path, final: Path, until: int | None = None) -> None:
    """Every file and directory of `final` fsync'd (before position `until` of the calls), the
    rename fsync'd in save_dir before `latest` is written, and `latest`'s rename after it."""
    inodes, calls = calls.inodes, list(calls[:until])
    files = [p for p in final.rglob("*") if p.is_file()]
    unsynced = [str(p) for p in files if min(inodes.get(_inode(p), [len(calls)])) >= len(calls)]
    assert files and not unsynced, "files never fsync'd"
    synced = {_published(path, save_dir) for path in calls}
    folders = [final, *(p for p in final.rglob("*") if p.is_dir())]
    assert not [str(p) for p in folders if str(p) not in synced], "directories never fsync'd"
    tmp_dir = str(save_dir / f"tmp-{final.name}")
    last_tmp = max(i for i, path in enumerate(calls) if path == tmp_dir)
    after_rename = [i for i, path in enumerate(calls) if path == str(save_dir) and i > last_tmp]
    assert after_rename, "save_dir is not fsync'd after the checkpoint directory is renamed into it"
    latest_written = min(i for i, path in enumerate(calls) if Path(path).name.startswith(".latest.tmp"))
    assert after_rename[0] < latest_written, "`latest` is written before the rename is on disk"
    assert calls[-1] == str(save_dir), "save_dir is not fsync'd after `latest` is replaced"


@pytest.mark.parametrize("resave", [False, True])
def test_every_file_and_directory_of_a_save_is_fsynced(tmp_path, monkeypatch, resave):
    save_dir = (tmp_path / "checkpoints").resolve()
    tokenizer_dir = _tokenizer(tmp_path)
    client_state = {"step": 4, "layout": {"tp": 1}}
    if resave:  # the same step again: the old directory is moved aside and deleted after the swap
        checkpoint.save(UnsyncedEngine(), save_dir, 4, client_state, write_extra=_write_part(tokenizer_dir))
    calls = _record_fsyncs(monkeypatch)
    final = checkpoint.save(UnsyncedEngine(), save_dir, 4, client_state, write_extra=_write_part(tokenizer_dir),
                            keep=1)
    assert {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()} >= {
        "mp_rank_00_model_states.pt", "rng_rank0.pt", "layout.json", "state.json", "manifest.json", "index.json",
        "shards/rank00000.safetensors", "shards/rank00000.json", "tokenizer/tokenizer.json"}
    _assert_durable(calls, save_dir, final)
    checkpoint.verify(final)


def test_each_file_is_fsynced_once_not_read_back(tmp_path, monkeypatch):
    save_dir = (tmp_path / "checkpoints").resolve()
    calls = _record_fsyncs(monkeypatch)
    final = checkpoint.save(UnsyncedEngine(), save_dir, 4, {"step": 4}, write_extra=_write_part(_tokenizer(tmp_path)))
    counts = {p.relative_to(final).as_posix(): len(calls.inodes.get(_inode(p), []))
              for p in final.rglob("*") if p.is_file()}
    assert set(counts.values()) == {1}, counts


def test_a_fast_tier_restore_fsyncs_its_copies_before_the_node_drops_them(tmp_path, monkeypatch):
    tier = FastTier(tmp_path / "shm", tmp_path / "run", rank=0, world=1)
    save_dir = (tmp_path / "run" / "checkpoints").resolve()
    write = _write_part(_tokenizer(tmp_path))
    tier.save(7, lambda part: checkpoint.write_rank_part(part, 0, {"step": 7}, None, write)())
    calls = _record_fsyncs(monkeypatch)
    clear = tier.clear
    monkeypatch.setattr(tier, "clear", lambda: (calls.append("<clear>"), clear()))
    line = tier.restore(save_dir, 5, lambda tmp, step, world: checkpoint.publish_dir(tmp, save_dir, step, world))
    assert line is not None and line.startswith("restored global_step7")
    final = save_dir / "global_step7"
    _assert_durable(calls, save_dir, final, until=calls.index("<clear>"))
    checkpoint.verify(final)


def test_atomic_write_text_fsyncs_the_file_then_its_directory(tmp_path, monkeypatch):
    from megaframe.common.atomic_io import atomic_write_text

    directory = tmp_path.resolve()
    calls = _record_fsyncs(monkeypatch)
    atomic_write_text(directory / "latest", "global_step4\n")
    assert len(calls) == 2 and Path(calls[0]).name.startswith(".latest.tmp") and calls[1] == str(directory)


def test_a_checkpoint_is_published_after_the_records_of_its_steps_are_on_disk(tmp_path, monkeypatch):
    """metrics.jsonl was flushed, never fsync'd: a node that crashed after a publish could resume at
    step N with the records of the steps before it lost, a gap in the run's curve. Rank 0 now fsyncs
    it before each save, with the step's own record already written."""
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.training.trainer import train
    from tests.support.helpers import TINY

    cfg, _ = compose([*TINY, "train.max_steps=2", "train.eval_interval=0", "train.save_interval=2",
                      "train.log_interval=1"])
    run_dir = tmp_path / "run"
    calls = _record_fsyncs(monkeypatch)
    # train(), not a bare Trainer: it restores the signal handlers and destroys the process group,
    # which a later test's forked ranks would otherwise inherit (and hang on, in this worker); and
    # the world of one's RANK/MASTER_* go with the test (later tests would think torchrun started them)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so that the teardown puts back what was there, or nothing
        monkeypatch.delenv(name)
    assert train(cfg, validate_for_engine(cfg, 1, ask_bf16=False), run_dir) == 0
    metrics = run_dir / "metrics.jsonl"
    synced = calls.inodes.get(_inode(metrics))
    assert synced, "metrics.jsonl is never fsync'd"
    latest_written = min(i for i, path in enumerate(calls) if Path(path).name.startswith(".latest.tmp"))
    assert min(synced) < latest_written, "`latest` names step 2 before the records of steps 1-2 are on disk"
