"""megaframe-sample's tokenizer: the checkpoint's copy of a Hugging Face tokenizer encodes the prompt
and decodes the samples, whose end is its eos token; a tokenizer that is gone or was never recorded
is one line naming the fix. Checkpoints written in-process (no training): the layouts and the
transformers parity are tests/e2e/test_sample_cli.py."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megaframe.config.schema import ModelConfig
from megaframe.convert.files import write_layout_free
from megaframe.model.factory import build_model, resolve_dims
from megaframe.model.full_state import full_state_dict
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from megaframe.sample_cli import main

VOCAB = 12
CFG = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=VOCAB,
                  seq_length=8, init_std=0.5)


def checkpoint(path, tokenizer_src=None, **state):
    model = build_model(resolve_dims(CFG, VOCAB, device_type="cpu"), ParallelState(ParallelDims(), rank=0), seed=1)
    write_layout_free(path, full_state_dict(model), {"step": 1, "consumed_samples": 8,
                                                    "model": dataclasses.asdict(CFG), **state}, tokenizer_src=tokenizer_src)
    return model.eval()


def word_tokenizer(directory):
    """A word-level HF tokenizer of the words w0..w10 and an eos token </s> (id 11), saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"</s>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>").save_pretrained(directory)
    return directory


def refusal(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_an_hf_tokenizer_run_samples_through_its_copied_tokenizer(tmp_path, capsys):
    tokenizer = word_tokenizer(tmp_path / "tok")
    model = checkpoint(tmp_path / "ckpt", tokenizer_src=tokenizer)
    # the run's tokenizer directory is gone: the checkpoint's copy serves
    for path in tokenizer.iterdir():
        path.unlink()
    main([str(tmp_path / "ckpt"), "--prompt", "w3 w5 w7", "--temperature", "0", "--max-new-tokens", "20", "--json"])
    [got] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert got["prompt_ids"] == [3, 5, 7]
    want = model.generate(torch.tensor([[3, 5, 7]]), 20, temperature=0, eod_id=VOCAB - 1)[0, 3:].tolist()
    stop = want.index(VOCAB - 1) if VOCAB - 1 in want else len(want)
    assert got["new_ids"] == want[:stop] and got["stopped"] == (stop < len(want))
    assert got["text"] == " ".join(f"w{i}" for i in want[:stop])
    # the human form: prompt and continuation as one text
    main([str(tmp_path / "ckpt"), "--prompt", "w3 w5 w7", "--temperature", "0", "--max-new-tokens", "20"])
    assert capsys.readouterr().out == " ".join(f"w{i}" for i in [3, 5, 7, *want[:stop]]) + "\n"
    # no prompt: a new document, which starts after the end-of-document token
    main([str(tmp_path / "ckpt"), "--temperature", "0", "--max-new-tokens", "3", "--json"])
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == [VOCAB - 1]


def test_a_missing_tokenizer_is_one_line(tmp_path, capsys):
    checkpoint(tmp_path / "gone", tokenizer=str(tmp_path / "deleted-tokenizer"))
    err = refusal(capsys, tmp_path / "gone", "--prompt", "hi")
    assert "deleted-tokenizer: no tokenizer files" in err and "--tokenizer DIR" in err
    checkpoint(tmp_path / "unrecorded")  # a from-hf import without a tokenizer records none
    err = refusal(capsys, tmp_path / "unrecorded", "--prompt", "hi")
    assert "records no tokenizer; pass --tokenizer byte" in err
    # --tokenizer names it; a prompt the model's 12 ids cannot hold is refused
    err = refusal(capsys, tmp_path / "unrecorded", "--tokenizer", "byte", "--prompt", "hi")
    assert "token id 104 is outside the vocabulary (0..11)" in err
    # no prompt starts a new document after the end-of-document id, which the model must hold
    err = refusal(capsys, tmp_path / "unrecorded", "--tokenizer", "byte")
    assert "the end-of-document id of byte: token id 256 is outside the vocabulary (0..11)" in err


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    checkpoint(tmp_path / "ckpt", tokenizer="byte")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("megaframe.model.generate.generate", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "ckpt"), "--prompt-ids", "1,2"])
    assert exit_info.value.code == 130 and capsys.readouterr().err == "megaframe-sample: interrupted\n"


def test_the_tokenizer_is_verified_against_the_checkpoints_record_and_read_from_where_the_run_trained(
        tmp_path, capsys, monkeypatch):
    """megaframe-sample took state["tokenizer"] as a path from the current directory, never checked
    it against the record's hash that to-hf checks, and `--tokenizer ""` fell back in silence. One
    rule for both (tokenizer_export.tokenizer_source)."""
    from megaframe.checkpoint import tokenizer_record as records

    tok = word_tokenizer(tmp_path / "tok")
    record = records.hf_record(tok, VOCAB, VOCAB - 1)
    checkpoint(tmp_path / "ckpt", **{records.RECORD_KEY: record, "tokenizer": str(tok)})  # no tokenizer/ copy
    edited = word_tokenizer(tmp_path / "edited")
    with open(edited / "tokenizer.json", "a") as f:
        f.write("\n")  # another tokenizer.json: same vocabulary size, not what the weights were trained with
    args = ["--prompt-ids", "3", "--max-new-tokens", "2", "--json"]
    assert "other files" in refusal(capsys, tmp_path / "ckpt", "--tokenizer", edited, *args)
    assert "--tokenizer is empty" in refusal(capsys, tmp_path / "ckpt", "--tokenizer", "", *args)
    assert "--tokenizer byte: " in refusal(capsys, tmp_path / "ckpt", "--tokenizer", "byte", *args)
    main([str(tmp_path / "ckpt"), *args])  # the recorded directory, verified: it samples
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == [3]
    with open(tok / "tokenizer.json", "a") as f:
        f.write("\n")  # edited after training, in place
    assert f"{tok}: other files" in refusal(capsys, tmp_path / "ckpt", *args)

    # an old checkpoint's relative data.tokenizer: from the directory the run was started in
    run, started = tmp_path / "run", tmp_path / "started"
    word_tokenizer(started / "toks" / "mine")
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {started}\n")
    checkpoint(run / "checkpoints" / "global_step1", tokenizer="toks/mine")
    (run / "checkpoints" / "latest").write_text("global_step1\n")
    monkeypatch.chdir(tmp_path)
    main([str(run / "checkpoints"), "--prompt", "w3 w5", *args[2:]])
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == [3, 5]


def test_a_seed_torch_cannot_take_and_a_prompt_file_without_end_are_one_line(tmp_path, capsys):
    """--seed 10^23 was "Overflow when unpacking long long" with no flag named; --prompt-file
    /dev/zero was read whole until the OOM killer ended it (found by review)."""
    ckpt = tmp_path / "ckpt"
    checkpoint(ckpt)
    assert refusal(capsys, ckpt, "--seed", "99999999999999999999999") == (
        "megaframe-sample: error: --seed=99999999999999999999999 must be in [-2^63, 2^64)")
    assert refusal(capsys, ckpt, "--seed", str(-2**63 - 1)).endswith("must be in [-2^63, 2^64)")
    large = tmp_path / "large.txt"
    with open(large, "wb") as file:  # sparse: 64 MiB and a byte, nothing written
        file.truncate((64 << 20) + 1)
    for path in (large, Path("/dev/zero")):
        assert refusal(capsys, ckpt, "--tokenizer", "byte", "--prompt-file", path) == (
            f"megaframe-sample: error: --prompt-file={path}: larger than 64 MiB; a prompt is at most the model's "
            f"context, give its end only")


def test_a_generation_that_cannot_be_held_is_one_line_at_once(tmp_path, capsys):
    """--max-new-tokens 1e11 ran silent until killed, growing its ids by torch.cat (review): the ids'
    buffer is made first, and a size memory cannot hold is refused before the first token."""
    checkpoint(tmp_path / "ckpt", tokenizer="byte")
    err = refusal(capsys, tmp_path / "ckpt", "--prompt-ids", "1,2", "--max-new-tokens", 10**15)
    assert err == ("megaframe-sample: error: --num-samples=1 samples of 2 prompt tokens and --max-new-tokens="
                   "1000000000000000 new tokens do not fit in cpu's memory; ask for fewer")


def test_a_long_generation_says_how_far_it_is_on_stderr(tmp_path, capsys, monkeypatch):
    checkpoint(tmp_path / "ckpt", tokenizer="byte")  # byte's end of document (256) is outside: never drawn
    monkeypatch.setattr("megaframe.sample_cli.PROGRESS_EVERY_S", 0.0)
    main([str(tmp_path / "ckpt"), "--prompt-ids", "1,2", "--max-new-tokens", "5", "--num-samples", "2", "--json"])
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"megaframe-sample: {n:,} of 5 new tokens (2 samples)" for n in range(1, 5)]
    assert [len(json.loads(line)["new_ids"]) for line in captured.out.splitlines()] == [5, 5]
    monkeypatch.setattr("sys.stderr", None)  # started with 2>&-: the lines went into the result (review)
    main([str(tmp_path / "ckpt"), "--prompt-ids", "1,2", "--max-new-tokens", "5", "--json"])
    assert [len(json.loads(line)["new_ids"]) for line in capsys.readouterr().out.splitlines()] == [5]


def test_a_prompt_of_bytes_that_are_not_utf8_names_the_flag(tmp_path, capsys):
    """The shell passes bytes Python keeps as surrogates: "'utf-8' codec can't encode characters in
    position 2-3: surrogates not allowed", naming nothing (review)."""
    checkpoint(tmp_path / "ckpt", tokenizer="byte")
    assert refusal(capsys, tmp_path / "ckpt", "--prompt", "ab\udcff\udcfecd") == (
        "megaframe-sample: error: --prompt holds bytes that are not UTF-8 text; write the prompt to a file in UTF-8 "
        "and pass --prompt-file FILE")
