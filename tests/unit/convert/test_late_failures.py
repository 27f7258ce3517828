"""What a conversion says when it ends late: a full disk mid-way names where (the kernel's ENOSPC on a
write to an open file names no file, and "No space left on device; nothing was published" left the
user to guess which disk), and a stop signal after the output is in place reports it complete."""
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


def test_a_stop_after_the_output_is_in_place_reports_it_complete(tmp_path, capsys, monkeypatch):
    """A Ctrl-C between the publish and the summary line said "nothing was published (an earlier
    output is untouched)" with exit 130, of an output in place, and from-hf's continue command was
    lost. One before the publish, over an earlier output (--force), still says nothing was published."""
    import signal

    from megaframe.convert import cli
    from megaframe.data.preprocess_stop import Stopped

    ckpt = checkpoint(tmp_path / "ckpt", GPT2, {})
    main(["to-hf", str(ckpt), str(tmp_path / "hf")])
    capsys.readouterr()

    def signal_once_done(convert):
        def converting(*args, **kwargs):
            convert(*args, **kwargs)
            raise Stopped(signal.SIGINT)  # as the handler raises it, the output just renamed into place
        return converting
    monkeypatch.setattr(cli, "import_hf", signal_once_done(cli.import_hf))
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")])  # returns: exit 0
    out, err = capsys.readouterr()
    assert out.startswith("continue pre-training with:\n  megaframe-train model.arch=gpt2 ")
    assert out.rstrip().endswith(f"train.resume={tmp_path / 'back'}")
    assert err == (f"megaframe-convert: stopped by SIGINT after {tmp_path / 'back'} was written and in place: it is "
                   "complete\n")
    assert (tmp_path / "back" / "state.json").is_file()

    monkeypatch.undo()  # and once the closing lines are out: not printed twice
    monkeypatch.setattr(cli, "_run", signal_once_done(cli._run))
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "again")])
    out, err = capsys.readouterr()
    assert out.count("continue pre-training with:") == 1 and err.endswith("it is complete\n")

    monkeypatch.undo()  # the summary's write fails (stdout a closed pipe): not "nothing was published"

    def closed_stdout(*args, **kwargs):
        if args and str(args[0]).startswith("wrote "):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr("builtins.print", closed_stdout)
    main(["to-hf", str(ckpt), str(tmp_path / "piped")])  # returns: exit 0
    monkeypatch.undo()
    assert capsys.readouterr().err == "" and (tmp_path / "piped" / "config.json").is_file()

    def stopped_first(tmp, final):
        raise Stopped(signal.SIGTERM)
    monkeypatch.setattr(cli.files, "publish", stopped_first)
    before = sorted(p.name for p in (tmp_path / "hf").iterdir())
    code, err = refusal(capsys, ["to-hf", str(ckpt), str(tmp_path / "hf"), "--force"])
    assert code == 143 and err.endswith("stopped by SIGTERM: nothing was published (an earlier output is untouched)\n")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before
