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
