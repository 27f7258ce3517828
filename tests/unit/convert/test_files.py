"""An export (megaframe/convert/files.py publish) reaches the disk before it replaces the previous
one: transformers' save_pretrained, the generation config and the tokenizer's copies are written
without fsync, and a crash soon after the rename left an export with empty config or tokenizer files,
its predecessor already deleted (--force)."""
from __future__ import annotations

import os

from megaframe.convert import files


def test_every_file_and_folder_is_flushed_before_the_export_replaces_the_old_one(tmp_path, monkeypatch):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("the previous export")
    staged = files.staging_dir(out, force=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "sub/merges.txt"):
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        (staged / name).write_text(name)
    flushed: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        if str(dst) == str(out):  # the export's rename: everything in it flushed by now
            flushed.append("renamed")
        return real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    files.publish(staged, out)
    before = flushed[:flushed.index("renamed")]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "sub/merges.txt", "sub"):
        assert str(staged / name) in before, (name, before)
    assert (out / "config.json").read_text() == "config.json"


def test_a_converted_checkpoint_is_split_into_files_the_ranks_share_when_they_verify(tmp_path, monkeypatch):
    """A from-hf checkpoint was one model.safetensors, which one rank hashed at every resume while
    the others waited (276 GB at 70B in fp32). Now its tensors are whole chunks in shard files of at
    most CONVERTED_FILE_BYTES (a larger tensor alone in its own), in the trained checkpoints' format."""
    import torch

    from megaframe.checkpoint import sharded, universal
    from megaframe.common.file_hash import hashing_shares

    monkeypatch.setattr(files, "CONVERTED_FILE_BYTES", 4096)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(16, 32, generator=g), "b": torch.randn(300, generator=g),
               "big": torch.randn(40, 40, generator=g), "c": torch.randn(8, 8, generator=g),
               "d": torch.randn(5, generator=g)}
    files.write_layout_free(tmp_path / "ckpt", tensors, {"step": 0, "consumed_samples": 0, "model": {}})
    ckpt = tmp_path / "ckpt"
    assert not (ckpt / universal.MODEL_FILE).exists()
    with sharded.ShardReader(ckpt) as reader:
        by_file: dict = {}
        for key in reader.keys():
            (chunk,) = reader.chunks(key)  # each tensor whole, in one file
            by_file.setdefault(chunk["file"], []).append(key)
    # in order, fp32 bytes a 2048 + b 1200 fit 4096; big (6400) alone; then c 256 + d 20
    assert sorted(by_file.values()) == [["a", "b"], ["big"], ["c", "d"]], by_file
    _, model, _ = sharded.read_universal(ckpt)
    assert model.keys() == tensors.keys() and all(torch.equal(model[k], tensors[k]) for k in tensors)
    sizes = {rel: meta["bytes"] for rel, meta in universal.read_manifest(ckpt)["files"].items()}
    shares = hashing_shares(sizes, 3)
    # three ranks verifying it hash one weights file each (the bytes split), not all on one rank
    assert sorted(sum(rel in by_file for rel in share) for share in shares) == [1, 1, 1], shares
    assert universal.read_state(ckpt)["version"] == universal.SHARDED_VERSION


def test_a_path_that_is_not_a_checkpoint_says_what_it_is_and_what_to_pass(tmp_path):
    """megaframe-eval, -sample, -convert and load_model said "not a layout-free megaframe checkpoint
    (needs state.json and index.json or model.safetensors)" for a missing path, a run directory, a
    run with no save yet and a Hugging Face export (which holds model.safetensors: the line
    contradicted itself)."""
    import pytest

    from megaframe.convert.hf import ConvertError

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    other = tmp_path / "other"
    other.mkdir()
    cases = {
        tmp_path / "gone": "gone: no such directory; pass a checkpoint (RUN/checkpoints/global_stepN)",
        run: f"run: a run directory, not a checkpoint; pass its checkpoints, {run / 'checkpoints'} (the newest)",
        run / "checkpoints": "checkpoints: no checkpoint in it yet (no `latest`: the run has not finished a save)",
        hf: f"hf: a Hugging Face model, not a megaframe checkpoint; import it first with megaframe-convert "
            f"from-hf {hf}",
        other: "other: not a layout-free megaframe checkpoint (needs state.json",
    }
    for path, message in cases.items():
        with pytest.raises(ConvertError) as refused:
            files.resolve_checkpoint(path)
        assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
