"""A conversion that fills the disk says where in one line: the kernel's ENOSPC on a write to an
open file names no file, and "No space left on device; nothing was published" left the user to
guess which disk (the output's staging folder, the checkpoint's, a temp folder)."""
from __future__ import annotations

import os

import pytest

from megaframe.checkpoint import stream
from megaframe.convert.cli import main
from tests.unit.convert.test_hf_tokenizer import GPT2, checkpoint


def fill_the_disk(monkeypatch) -> None:
    """From now on every weight file is written to /dev/full: its writes fail as a full disk's do."""
    monkeypatch.setattr(stream, "create_fresh", lambda path: os.open("/dev/full", os.O_WRONLY))


def refusal(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as code:
        main(argv)
    return code.value.code, capsys.readouterr().err


def test_to_hf_and_from_hf_on_a_full_disk_name_the_folder_to_free(tmp_path, capsys, monkeypatch):
    ckpt = checkpoint(tmp_path / "ckpt", GPT2, {})
    main(["to-hf", str(ckpt), str(tmp_path / "hf")])  # a Hugging Face directory to import, while there is room
    capsys.readouterr()
    out = tmp_path / "full" / "out"
    out.parent.mkdir()
    fill_the_disk(monkeypatch)
    for argv in (["to-hf", str(ckpt), str(out)], ["from-hf", str(tmp_path / "hf"), str(out)]):
        code, error = refusal(capsys, argv)
        assert code == 1 and error == (
            f"megaframe-convert: error: No space left on device writing {out}; free space in {out.parent} or "
            "write elsewhere; nothing was published (an earlier output is untouched)\n"), (argv[0], error)
        assert os.listdir(out.parent) == [], argv[0]  # its staging folder removed too
