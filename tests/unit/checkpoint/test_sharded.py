"""The sharded layer on its own: chunks written by the 'ranks' of one split read back in another.

The writers cut each tensor the way a layout does (a TP shard along a dimension, then ZeRO's flat
range of that shard); the reader asks for the boxes another layout needs. Every value must come
back bit-exact, padding rows as zeros; a save that does not cover a tensor is refused."""
from __future__ import annotations

import json

import pytest
import torch

from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint.boxes import Box, even_range, flat_range_boxes
from megaframe.checkpoint.universal import CheckpointError

FULL = {"w": torch.randn(10, 6), "b": torch.randn(12), "exp_avg.w": torch.randn(10, 6)}


def _pieces_of(full: dict, tp: int, dp: int, tp_rank: int, dp_rank: int, dim: int) -> list[sharded.Piece]:
    """What rank (tp_rank, dp_rank) writes: its TP shard along `dim`, and of that its dp part."""
    pieces = []
    for key, value in full.items():
        d = min(dim, value.dim() - 1)
        size = value.shape[d] // tp
        shard = value.narrow(d, tp_rank * size, size).contiguous()
        offset = [0] * value.dim()
        offset[d] = tp_rank * size
        start, stop = even_range(shard.numel(), dp_rank, dp)
        flat, position = shard.flatten(), 0
        for local in flat_range_boxes(tuple(shard.shape), start, stop):
            box = local.shifted(tuple(offset))
            pieces.append(sharded.Piece(key, tuple(value.shape), box,
                                        lambda flat=flat, at=start + position, n=local.numel: flat[at:at + n]))
            position += local.numel
    return pieces


def _save(directory, tp: int, dp: int, dim: int, full=FULL) -> None:
    directory.mkdir()
    for tp_rank in range(tp):
        for dp_rank in range(dp):
            rank = tp_rank * dp + dp_rank
            record = sharded.write_rank_shard(directory, rank, _pieces_of(full, tp, dp, tp_rank, dp_rank, dim))
            sharded.write_record(directory, record)
    hashed = sharded.merge_records(directory, tp * dp)
    universal.write_manifest(directory, hashed)


@pytest.mark.parametrize("tp,dp,dim", [(1, 1, 0), (2, 3, 0), (2, 2, 1), (1, 4, 1)])
def test_any_split_reads_back_in_other_boxes(tmp_path, tp, dp, dim):
    _save(tmp_path / "ckpt", tp, dp, dim)
    universal.verify_manifest(tmp_path / "ckpt")  # hashes the ranks reported are the files' hashes
    with sharded.ShardReader(tmp_path / "ckpt") as reader:
        assert sorted(reader.keys()) == sorted(FULL)
        for key, value in FULL.items():
            assert torch.equal(reader.full(key), value)
        # another layout's piece: columns 2..5 of rows 3..9; past the stored rows of a tensor whose rows
        # are no vocabulary, a read is refused (no zeros where nothing declared padding)
        assert torch.equal(reader.read("w", Box((3, 2), (6, 3))), FULL["w"][3:9, 2:5])
        with pytest.raises(CheckpointError, match="tensor w of shape \\[10, 6\\] is read at offset \\[8, 0\\]"):
            reader.read("w", Box((8, 0), (4, 6)))


def test_incomplete_save_is_refused(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    sharded.write_record(directory, sharded.write_rank_shard(directory, 0, _pieces_of(FULL, 2, 1, 0, 0, 0)))
    sharded.write_record(directory, {"rank": 1, "files": {}, "tensors": {}})  # rank 1 lost its shard
    with pytest.raises(CheckpointError, match=r"b: no chunk covers element \[6\] of its shape \[12\]"):
        sharded.merge_records(directory, 2)


def test_wait_for_records_names_the_missing_ranks(tmp_path):
    sharded.write_record(tmp_path, {"rank": 0, "files": {}, "tensors": {}})
    with pytest.raises(CheckpointError, match=r"ranks \[1, 2\] did not finish"):
        sharded.wait_for_records(tmp_path, 3, timeout_s=0.1)


def test_index_naming_a_file_outside_is_refused(tmp_path):
    _save(tmp_path / "ckpt", 1, 2, 0)
    group_path = tmp_path / "ckpt" / sharded.INDEX_DIR / "b.json"
    chunks = json.loads(group_path.read_text())
    chunks["b"][0]["file"] = "../elsewhere.safetensors"
    group_path.write_text(json.dumps(chunks))
    with sharded.ShardReader(tmp_path / "ckpt") as reader, pytest.raises(CheckpointError, match="outside"):
        reader.full("b")


def test_a_reader_loads_only_the_index_groups_it_touches(tmp_path):
    """A rank resuming a pipeline stage reads the chunk lists of its own layers, not the model's."""
    full = {"blocks.0.w": torch.randn(4, 3), "blocks.1.w": torch.randn(4, 3), "exp_avg.blocks.1.w": torch.randn(4, 3),
            "embed.tok.weight": torch.randn(5, 3)}
    _save(tmp_path / "ckpt", 1, 2, 0, full=full)
    groups = sorted(p.name for p in (tmp_path / "ckpt" / sharded.INDEX_DIR).iterdir())
    assert groups == ["blocks.0.json", "blocks.1.json", "embed.json"]
    with sharded.ShardReader(tmp_path / "ckpt") as reader:
        assert sorted(reader.keys()) == sorted(full)  # every tensor's name and shape, from index.json
        assert torch.equal(reader.full("exp_avg.blocks.1.w"), full["exp_avg.blocks.1.w"])
        assert sorted(reader._chunks) == ["blocks.1.w", "exp_avg.blocks.1.w"]  # blocks.1's group only


def test_version_1_files_read_through_the_same_reader(tmp_path):
    model = {"w": FULL["w"], "b": FULL["b"]}
    path = universal.write_universal(tmp_path / "v1", model, {"step": 1, "consumed_samples": 0, "model": {}},
                                     {"exp_avg.w": FULL["exp_avg.w"]})
    with sharded.ShardReader(path) as reader:
        assert sorted(reader.keys()) == sorted(FULL)
        assert torch.equal(reader.read("w", Box((2, 1), (3, 4))), FULL["w"][2:5, 1:5])
    state, got_model, got_optim = sharded.read_universal(path)
    assert state["version"] == universal.VERSION and set(got_model) == {"w", "b"} and set(got_optim) == {"exp_avg.w"}


def test_waiting_for_records_looks_again_only_for_the_missing_ones(tmp_path, monkeypatch):
    """At thousands of ranks, a stat of every record every 50 ms flooded the metadata server: a rank
    seen once is not looked for again, and the pauses grow to a second."""
    from pathlib import Path

    for rank in range(3):
        sharded.write_record(tmp_path, {"rank": rank, "files": {}, "tensors": {}})
    looked, pauses, real = [], [], Path.is_file

    def is_file(path):
        looked.append(path.name)
        return real(path) and (path.name != sharded.record_file(1).split("/")[-1] or len(pauses) >= 10)

    monkeypatch.setattr(Path, "is_file", is_file)
    monkeypatch.setattr(sharded.time, "sleep", pauses.append)
    sharded.wait_for_records(tmp_path, 3, timeout_s=60)
    record_1 = sharded.record_file(1).split("/")[-1]
    assert looked.count(record_1) == 11 and len(looked) == 2 + 11, looked
    assert pauses[0] == 0.05 and pauses[-1] == 1.0 and pauses == sorted(pauses)


def test_a_ranks_optimizer_state_is_a_file_of_its_own_that_a_weights_reader_does_not_hash(tmp_path):
    """Each rank writes its weights and its optimizer state to two files. A reader of the weights alone
    (megaframe-convert, load_model) verifies every file but the optimizer's: bit rot there does not stop
    an export, while damage to a weights file, the index or state.json still does."""
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 2, 2, 0)
    universal.write_state(ckpt, {"step": 1, "consumed_samples": 8, "model": {}})
    hashed = sharded.merge_records(ckpt, 4)
    universal.write_manifest(ckpt, hashed)
    files = sorted(p.name for p in (ckpt / "shards").glob("*.safetensors"))
    assert files == sorted([f"rank{r:05d}.safetensors" for r in range(4)] +
                           [f"rank{r:05d}.optimizer.safetensors" for r in range(4)])
    with sharded.ShardReader(ckpt) as reader:
        assert {c["file"] for c in reader.chunks("exp_avg.w")} == {f"shards/rank{r:05d}.optimizer.safetensors"
                                                                   for r in range(4)}
        assert all(".optimizer." not in c["file"] for key in ("w", "b") for c in reader.chunks(key))
    optimizer_file = ckpt / "shards" / "rank00003.optimizer.safetensors"
    data = bytearray(optimizer_file.read_bytes())
    data[-1] ^= 0xFF
    optimizer_file.write_bytes(bytes(data))
    _, model, _ = sharded.read_universal(ckpt, optimizer_state=False)
    assert torch.equal(model["w"], FULL["w"]) and torch.equal(model["b"], FULL["b"])
    with pytest.raises(CheckpointError, match="rank00003.optimizer.safetensors does not match its sha256"):
        sharded.read_universal(ckpt)  # a reader of the optimizer state hashes it
    # a flipped byte in the weights, and an index edited but still one the reader accepts (only its hash can
    # tell): the index that decides what is skipped is verified too
    index = ckpt / "index.json"
    edited = {**json.loads(index.read_text()), "edited": True}
    for target, damaged in ((ckpt / "shards" / "rank00001.safetensors", None), (index, json.dumps(edited))):
        original = target.read_bytes()
        target.write_bytes(damaged.encode() if damaged else original[:-1] + bytes([original[-1] ^ 0x01]))
        with pytest.raises(CheckpointError, match="does not match its sha256|is truncated or corrupted"):
            sharded.verify_for_weights(ckpt)
        target.write_bytes(original)
    # a file nothing vouches for, planted where the index would lead a reader
    (ckpt / "index" / "planted.json").write_text("{}")
    with pytest.raises(CheckpointError, match="index/planted.json is not in manifest.json"):
        sharded.verify_for_weights(ckpt)


def test_an_index_the_manifest_does_not_list_is_refused_by_a_resume_and_by_a_full_read(tmp_path):
    """A manifest vouches for the files it lists; the reader finds tensors through index.json and its
    groups. An index outside the manifest (a version-1 checkpoint's manifest lists only its two files,
    and an index.json planted beside them would be followed) is refused before anything is read, by a
    resume (store.manifest_problem, every rank's verdict) and by a full read, as by a weights reader."""
    from megaframe.checkpoint import store

    ckpt = tmp_path / "ckpt"
    _save(ckpt, 2, 1, 0)
    universal.write_state(ckpt, {"step": 1, "consumed_samples": 8, "model": {}})
    hashed = sharded.merge_records(ckpt, 2)
    universal.write_manifest(ckpt, hashed)
    (ckpt / "index" / "._w.json").write_bytes(b"\x00\x05")  # what a copy made on macOS leaves: not ours, not read
    assert store.manifest_problem(ckpt) is None
    assert torch.equal(sharded.read_universal(ckpt)[1]["w"], FULL["w"])
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["index.json"]  # as if index.json came after the manifest was written
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert "index.json is not in manifest.json" in (store.manifest_problem(ckpt) or "")
    for read in (sharded.read_universal, lambda c: sharded.read_universal(c, optimizer_state=False)):
        with pytest.raises(CheckpointError, match="index.json is not in manifest.json"):
            read(ckpt)
