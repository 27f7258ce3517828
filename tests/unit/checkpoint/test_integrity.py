"""A damaged checkpoint is one line with exit 5 naming the tensor or file, never zeros and never
torch's advice to turn weights_only off: chunk coverage (checkpoint/coverage.py), declared
vocabulary padding, and the readers of the index, the manifest, state.json and the RNG files."""
from __future__ import annotations

import io
import os
import json
from pathlib import Path

import pytest
import torch

from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint.boxes import Box, even_range, flat_range_boxes
from megaframe.checkpoint.coverage import coverage_problem
from megaframe.checkpoint.universal import CheckpointError
from megaframe.common.failures import ExitCode, classify
from megaframe.checkpoint import store as checkpoint

FULL = {"embed.tok.weight": torch.randn(7, 4), "exp_avg.embed.tok.weight": torch.randn(7, 4),
        "blocks.0.w": torch.randn(5, 6)}


def _save(directory: Path, ranks: int = 3) -> Path:
    """Each tensor split over `ranks` as ZeRO's flat ranges (partial rows included), then merged."""
    directory.mkdir()
    for rank in range(ranks):
        pieces = []
        for key, value in FULL.items():
            start, stop = even_range(value.numel(), rank, ranks)
            flat, position = value.flatten(), start
            for box in flat_range_boxes(tuple(value.shape), start, stop):
                pieces.append(sharded.Piece(key, tuple(value.shape), box,
                                            lambda flat=flat, at=position, n=box.numel: flat[at:at + n]))
                position += box.numel
        sharded.write_record(directory, sharded.write_rank_shard(directory, rank, pieces))
    universal.write_state(directory, {"version": universal.SHARDED_VERSION, "step": 1, "consumed_samples": 0,
                                      "model": {}})
    universal.write_manifest(directory, sharded.merge_records(directory, ranks))
    return directory


def _edit_group(directory: Path, group: str, edit) -> None:
    path = directory / sharded.INDEX_DIR / f"{group}.json"
    chunks = json.loads(path.read_text())
    edit(chunks)
    path.write_text(json.dumps(chunks))


def _refused(directory: Path, key: str, *fragments: str) -> str:
    with sharded.ShardReader(directory) as reader, pytest.raises(CheckpointError) as error:
        reader.full(key)
    message = str(error.value)
    assert "\n" not in message and classify(error.value).exit_code == ExitCode.BAD_CHECKPOINT == 5
    for fragment in (f"tensor {key}", *fragments):
        assert fragment in message, (fragment, message)
    return message


@pytest.fixture
def saved(tmp_path) -> Path:
    return _save(tmp_path / "ckpt")


def test_padding_is_declared_in_the_index_and_reads_as_zeros_only_there(saved):
    index = json.loads((saved / sharded.INDEX_FILE).read_text())
    assert index["padding"] == sharded.PADDING_DECLARED
    assert {k: e["pad_rows"] for k, e in index["tensors"].items()} == {
        "embed.tok.weight": True, "exp_avg.embed.tok.weight": True, "blocks.0.w": False}
    with sharded.ShardReader(saved) as reader:
        for key, value in FULL.items():
            assert torch.equal(reader.full(key), value)
        padded = reader.read("embed.tok.weight", Box((4, 0), (6, 4)))  # a layout padding 7 rows to 10
        assert torch.equal(padded[:3], FULL["embed.tok.weight"][4:]) and not padded[3:].any()
        with pytest.raises(CheckpointError, match="tensor blocks.0.w of shape \\[5, 6\\] is read at offset \\[3, 0\\]"):
            reader.read("blocks.0.w", Box((3, 0), (4, 6)))
        with pytest.raises(CheckpointError, match="outside what it stores"):  # columns are never padding
            reader.read("embed.tok.weight", Box((0, 0), (7, 5)))


def test_an_index_written_before_the_declaration_pads_the_vocabulary_rows_by_name(saved):
    index = json.loads((saved / sharded.INDEX_FILE).read_text())
    del index["padding"]
    for entry in index["tensors"].values():
        del entry["pad_rows"]
    (saved / sharded.INDEX_FILE).write_text(json.dumps(index))
    with sharded.ShardReader(saved) as reader:
        assert not reader.read("exp_avg.embed.tok.weight", Box((6, 0), (2, 4)))[1:].any()
        with pytest.raises(CheckpointError, match="outside what it stores"):
            reader.read("blocks.0.w", Box((4, 0), (2, 6)))


def test_a_missing_chunk_is_exit_5_naming_the_tensor_not_zeros(saved):
    _edit_group(saved, "blocks.0", lambda chunks: chunks["blocks.0.w"].pop(1))
    _refused(saved, "blocks.0.w", "no chunk covers element", "a chunk is missing", "use an earlier one")


def test_a_missing_chunk_is_refused_by_eval_and_export_too(saved):
    """eval and to-hf read through read_universal / model_tensors: the same reader, their exit 2 line."""
    from megaframe.convert.files import model_tensors
    from megaframe.convert.hf import ConvertError

    _edit_group(saved, "embed", lambda chunks: chunks["embed.tok.weight"].pop())
    with pytest.raises(CheckpointError, match="tensor embed.tok.weight: no chunk covers"):
        sharded.read_universal(saved, verify=False)
    with sharded.ShardReader(saved) as reader, pytest.raises(ConvertError, match="tensor embed.tok.weight"):
        model_tensors(reader)["embed.tok.weight"]


def test_an_overlapping_chunk_is_exit_5(saved):
    def overlap(chunks):  # the second chunk starts one element early: its first overlaps the first's last
        second = chunks["blocks.0.w"][1]
        second["offset"][1] -= 1 if second["offset"][1] else 0
        second["offset"][0] -= 0 if second["offset"][1] else 1
    _edit_group(saved, "blocks.0", overlap)
    _refused(saved, "blocks.0.w", "two chunks overlap")


def test_a_chunk_out_of_bounds_or_of_wrong_types_is_exit_5(saved):
    _edit_group(saved, "blocks.0", lambda chunks: chunks["blocks.0.w"][0].update(offset=[4, 0], shape=[2, 6]))
    _refused(saved, "blocks.0.w", "reaches beyond the tensor's shape [5, 6]")
    _edit_group(saved, "blocks.0", lambda chunks: chunks["blocks.0.w"][0].update(offset=["0", 0]))
    _refused(saved, "blocks.0.w", "not 2 whole numbers >= 0")


def test_a_chunk_whose_file_holds_another_shape_is_exit_5_naming_the_file(saved):
    def swap(chunks):  # two chunks trade places in the index: coverage holds, the files disagree
        a, b = chunks["blocks.0.w"][0], chunks["blocks.0.w"][1]
        a["key"], b["key"] = b["key"], a["key"]
        a["file"], b["file"] = b["file"], a["file"]
    _edit_group(saved, "blocks.0", swap)
    _refused(saved, "blocks.0.w", "does not hold chunk", "shards/rank0000")


def test_a_truncated_or_garbage_shard_is_exit_5_naming_it(saved):
    shard = saved / "shards" / "rank00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:40])
    _refused(saved, "blocks.0.w", "shards/rank00001.safetensors (holding tensor blocks.0.w) is not a readable")
    shard.write_bytes(b"\xff" * 64)
    _refused(saved, "blocks.0.w", "shards/rank00001.safetensors (holding tensor blocks.0.w) is not a readable")


@pytest.mark.parametrize("content,fragment", [
    ({"tensors": [1, 2]}, "index.json is damaged"),
    ({"tensors": {"blocks.0.w": {"shape": "5x6", "group": "blocks.0"}}}, "index.json is damaged"),
    (b"\x00\x9c garbage", "index.json is not valid JSON"),
])
def test_an_index_of_wrong_types_or_garbage_is_exit_5(saved, content, fragment):
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    (saved / sharded.INDEX_FILE).write_bytes(raw)
    with pytest.raises(CheckpointError, match=fragment) as error:
        sharded.ShardReader(saved)
    assert "garbage" not in str(error.value)


@pytest.mark.parametrize("content,fragment", [
    ({"files": {"state.json": {"bytes": "12", "sha256": "00"}}}, "its file table is not"),
    ({"files": [1]}, "its file table is not"),
    (["files"], "its file table is not"),
    (b"secret-content " * 10, "manifest.json is not valid JSON"),
])
def test_a_manifest_of_wrong_types_or_garbage_is_exit_5_quoting_nothing(saved, content, fragment):
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    (saved / universal.MANIFEST_FILE).write_bytes(raw)
    with pytest.raises(CheckpointError, match=fragment) as error:
        universal.verify_manifest(saved)
    assert "secret" not in str(error.value) and "\n" not in str(error.value)


def test_state_json_that_is_no_object_or_a_link_is_exit_5(saved):
    (saved / universal.STATE_FILE).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="state.json holds no JSON object"):
        universal.read_state(saved)
    (saved / universal.STATE_FILE).unlink()
    (saved / universal.STATE_FILE).symlink_to("/etc/passwd")
    with pytest.raises(CheckpointError, match="symbolic link") as error:
        universal.read_state(saved)
    assert "root:" not in str(error.value)


def test_a_garbage_or_truncated_rng_pickle_is_exit_5_without_torchs_weights_only_advice(tmp_path):
    good = io.BytesIO()
    torch.save({"cpu": torch.get_rng_state()}, good)
    cases = {"garbage": b"\x80\x04garbage-not-a-pickle" * 8, "truncated": good.getvalue()[:200],
             "a crafted pickle": b"cos\nsystem\n(S'echo pwned'\ntR."}
    for name, raw in cases.items():
        path = tmp_path / "rng_rank0.pt"
        path.write_bytes(raw)
        with pytest.raises(CheckpointError) as error:
            checkpoint.load_tensors_pickle(path)
        message = str(error.value)
        assert str(path) in message and "is damaged" in message and "weights_only" not in message, (name, message)
        assert classify(error.value).exit_code == ExitCode.BAD_CHECKPOINT
    path.write_bytes(good.getvalue())
    assert torch.equal(checkpoint.load_tensors_pickle(path)["cpu"], torch.get_rng_state())


def test_the_writer_refuses_an_overlap_whose_element_count_matches(tmp_path):
    """Two ranks writing the same rows and none writing others summed to the right count: refused."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    value = torch.randn(4, 3)
    for rank in range(2):
        piece = sharded.Piece("blocks.0.w", (4, 3), Box((0, 0), (2, 3)), lambda: value[:2])
        sharded.write_record(directory, sharded.write_rank_shard(directory, rank, [piece]))
    with pytest.raises(CheckpointError, match="blocks.0.w: two chunks overlap at element \\[0, 0\\]"):
        sharded.merge_records(directory, 2)


def test_coverage_of_many_zero_partitions_is_fast_and_exact():
    """3,072 ZeRO ranks over a (1000, 77) tensor: ~3,900 chunks, checked by a sweep, not cell by cell."""
    import time

    shape = (1000, 77)
    boxes = [box for rank in range(3072) for box in flat_range_boxes(shape, *even_range(77000, rank, 3072))]
    chunks = [{"file": "f", "key": str(i), "offset": list(b.offset), "shape": list(b.shape)} for i, b in enumerate(boxes)]
    started = time.perf_counter()
    assert coverage_problem(shape, chunks) is None
    assert time.perf_counter() - started < 2.0
    assert "no chunk covers element [1, 27]" in coverage_problem(shape, chunks[:5] + chunks[6:])
    assert "overlap" in coverage_problem(shape, chunks + chunks[100:101])


@pytest.mark.parametrize("threads", [1, 3])
def test_hashing_on_threads_names_the_first_bad_file_in_the_manifests_order(tmp_path, threads):
    """The offline tools hash on several threads (one thread took hours at 1 TB): the verdict is the
    single-threaded one, the first corrupted file in the listed order, whichever thread finished first."""
    from megaframe.common.file_hash import hash_file

    files = {}
    for name in "abcde":
        (tmp_path / name).write_bytes(name.encode() * 100_000)
        files[name] = {"bytes": 100_000, "sha256": hash_file(tmp_path / name)}
    universal.verify_files(tmp_path, files, threads=threads)
    for name in ("d", "b"):
        (tmp_path / name).write_bytes(b"x" * 100_000)  # same size, other bytes
    with pytest.raises(universal.CheckpointError, match=r": b does not match its sha256"):
        universal.verify_files(tmp_path, files, threads=threads)


def test_a_fifo_folder_or_link_where_a_checkpoint_file_was_is_named_as_what_it_is(saved, tmp_path):
    """A FIFO or a folder in a listed file's place was "missing", manifest.json's "has no
    manifest.json", state.json's "not a layout-free checkpoint (needs state.json ...)"; a shard or
    a global_stepN linked to other storage "names ..., outside the checkpoint directory; the file
    was edited", which sent the user to a good `latest` (review)."""
    from megaframe.convert.files import ConvertError, resolve_checkpoint

    universal.verify_manifest(saved)
    shard = saved / "shards" / "rank00001.safetensors"
    copy = tmp_path / "elsewhere.safetensors"
    copy.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(copy)
    with pytest.raises(CheckpointError, match=f"^checkpoint {saved}: {shard} is a symbolic link \\(to {copy}\\) "
                                              f"leading outside {saved}; megaframe reads no link out of a checkpoint"):
        universal.verify_manifest(saved)
    shard.unlink()
    os.mkfifo(shard)  # nobody writes it: reading it would wait
    with pytest.raises(CheckpointError, match=f"^checkpoint {saved}: {shard} is a FIFO, not a file megaframe wrote; "
                                              f"the checkpoint was changed since it was saved$"):
        universal.verify_manifest(saved)
    manifest = saved / universal.MANIFEST_FILE
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(CheckpointError, match=f"{manifest} is a directory, not a file megaframe wrote"):
        universal.verify_manifest(saved)
    state = saved / universal.STATE_FILE
    state.unlink()
    os.mkfifo(state)
    with pytest.raises(ConvertError, match=f"^{state} is a FIFO, not a file megaframe wrote"):
        resolve_checkpoint(saved)
    run = tmp_path / "run" / "checkpoints"  # a global_stepN linked to other storage, `latest` naming it
    run.mkdir(parents=True)
    (run / "global_step5").symlink_to(saved)
    (run / "latest").write_text("global_step5\n")
    with pytest.raises(ConvertError, match=f"{run / 'global_step5'} is a symbolic link \\(to {saved}\\) leading "
                                           f"outside {run}"):
        resolve_checkpoint(run)


def test_a_checkpoint_under_a_folder_name_that_is_not_utf8_names_the_path(saved, tmp_path):
    """A good checkpoint below a folder named in another encoding was "not a readable safetensors
    file ... use an earlier checkpoint": safetensors opens only UTF-8 paths (review)."""
    odd = tmp_path / "odd\udcff"  # the byte 0xff, as Python keeps a name the file system gives it
    odd.mkdir()
    moved = saved.rename(odd / "ckpt")
    with sharded.ShardReader(moved) as reader, pytest.raises(CheckpointError) as error:
        reader.full("blocks.0.w")
    assert str(error.value).endswith(": its path is not UTF-8 text, which safetensors cannot open; rename the folder "
                                     "(or move the checkpoint) to a UTF-8 name"), str(error.value)
