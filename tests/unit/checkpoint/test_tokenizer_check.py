"""Resume refuses another tokenizer than the checkpoint's (one line naming data.tokenizer, exit 5),
even one with the same vocabulary size; checkpoints written before records resume with a note."""
from __future__ import annotations

import shutil

import pytest

from megaframe.checkpoint import universal
from megaframe.checkpoint.universal import CheckpointError
from megaframe.config.schema import DataConfig
from megaframe.data.indexed import DataError
from megaframe.common.failures import ExitCode, classify
from megaframe.checkpoint.tokenizer_check import RECORD_KEY, check_resume, run_record
from tests.support.word_tokenizer import save_word_tokenizer, swap_words


def saved_checkpoint(path, record=None, tokenizer_dir=None):
    """A layout-free checkpoint's state.json (the tensors do not matter to the check)."""
    path.mkdir(parents=True)
    (path / universal.MODEL_FILE).write_bytes(b"")
    state = {"step": 2, "consumed_samples": 16, "model": {}}
    if record is not None:
        state[RECORD_KEY] = record
    universal.write_state(path, state, tokenizer_dir)
    return path


def refusal(path, current) -> str:
    with pytest.raises(CheckpointError) as error:
        check_resume(path, current, announce=True)
    message = str(error.value)
    assert "\n" not in message and "data.tokenizer=" in message
    assert classify(error.value).exit_code == ExitCode.BAD_CHECKPOINT
    return message


def test_same_tokenizer_resumes_and_a_copy_of_it_too(tmp_path, capsys):
    tok = save_word_tokenizer(tmp_path / "tok")
    ckpt = saved_checkpoint(tmp_path / "ckpt", run_record(DataConfig(tokenizer=str(tok))), tok)
    check_resume(ckpt, run_record(DataConfig(tokenizer=str(tok))), announce=True)
    # the fix the refusal proposes, the checkpoint's own copy, is accepted
    check_resume(ckpt, run_record(DataConfig(tokenizer=str(ckpt / "tokenizer"))), announce=True)
    byte = saved_checkpoint(tmp_path / "byte", run_record(DataConfig(tokenizer="byte")))
    check_resume(byte, run_record(DataConfig(tokenizer="byte")), announce=True)
    assert capsys.readouterr().err == ""


def test_tokenizer_edited_with_the_same_vocabulary_is_refused(tmp_path):
    tok = save_word_tokenizer(tmp_path / "tok")
    ckpt = saved_checkpoint(tmp_path / "ckpt", run_record(DataConfig(tokenizer=str(tok))), tok)
    swap_words(tok)  # edited between the runs: 11 tokens still, eos still 1
    current = run_record(DataConfig(tokenizer=str(tok)))
    assert current["vocab_size"] == 11 and current["eod_id"] == 1
    message = refusal(ckpt, current)
    assert "differs in its files' sha256" in message
    assert f"set data.tokenizer={ckpt / 'tokenizer'} (the checkpoint's copy)" in message


def test_another_end_of_document_id_is_refused_naming_it(tmp_path):
    tok = save_word_tokenizer(tmp_path / "tok")
    ckpt = saved_checkpoint(tmp_path / "ckpt", run_record(DataConfig(tokenizer=str(tok))))
    other = save_word_tokenizer(tmp_path / "other", eos="[UNK]")
    message = refusal(ckpt, run_record(DataConfig(tokenizer=str(other))))
    assert "differs in end-of-document id (1 -> 0)" in message
    assert f"set data.tokenizer={tok.resolve()}" in message  # no copy in this checkpoint: the original


def test_switching_between_byte_and_an_hf_tokenizer_is_refused(tmp_path):
    tok = save_word_tokenizer(tmp_path / "tok")
    byte = saved_checkpoint(tmp_path / "byte", run_record(DataConfig(tokenizer="byte")))
    assert "differs in kind (byte -> hf)" in refusal(byte, run_record(DataConfig(tokenizer=str(tok))))
    hf = saved_checkpoint(tmp_path / "hf", run_record(DataConfig(tokenizer=str(tok))), tok)
    assert "differs in kind (hf -> byte)" in refusal(hf, run_record(DataConfig(tokenizer="byte")))


def test_engine_only_checkpoint_is_checked_from_its_client_state(tmp_path):
    ckpt = tmp_path / "native"
    ckpt.mkdir()
    check_resume(ckpt, run_record(DataConfig(tokenizer="byte")), announce=True)  # nothing to read yet
    tok = save_word_tokenizer(tmp_path / "tok")
    with pytest.raises(CheckpointError, match="differs in kind"):
        check_resume(ckpt, run_record(DataConfig(tokenizer=str(tok))), announce=True,
                     client_state={RECORD_KEY: run_record(DataConfig(tokenizer="byte"))})


def test_old_checkpoint_without_a_record_resumes_with_one_line(tmp_path, capsys):
    ckpt = saved_checkpoint(tmp_path / "old")
    check_resume(ckpt, run_record(DataConfig(tokenizer="byte")), announce=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "records no tokenizer" in lines[0] and "data.tokenizer" in lines[0]
    check_resume(ckpt, run_record(DataConfig(tokenizer="byte")), announce=False)  # ranks > 0 stay quiet
    assert capsys.readouterr().err == ""


def test_edited_record_is_refused(tmp_path):
    ckpt = saved_checkpoint(tmp_path / "ckpt", record="byte")
    with pytest.raises(CheckpointError, match=f"its {RECORD_KEY} is not a tokenizer record"):
        check_resume(ckpt, run_record(DataConfig(tokenizer="byte")), announce=True)


def test_run_record_of_a_tokenizer_without_eos_is_one_data_error(tmp_path):
    tok = save_word_tokenizer(tmp_path / "tok")
    config = tok / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"eos_token": "</s>"', '"eos_token": null'))
    with pytest.raises(DataError, match=f"data.tokenizer={tok}: tokenizer has no eos_token"):
        run_record(DataConfig(tokenizer=str(tok)))


def test_checkpoint_copy_holds_only_the_tokenizer_files(tmp_path):
    """data.tokenizer may name a model directory: its weights are not copied into every checkpoint."""
    tok = save_word_tokenizer(tmp_path / "tok")
    (tok / "model.safetensors").write_bytes(b"0" * 1000)
    shutil.copytree(tok, tmp_path / "model")
    ckpt = saved_checkpoint(tmp_path / "ckpt", None, tmp_path / "model")
    assert sorted(p.name for p in (ckpt / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_tokenizer_linked_into_a_cache_snapshot_is_recorded_and_copied_as_files(tmp_path):
    """A Hugging Face cache's snapshot links each file to a blob: the content counts, and the
    checkpoint holds plain files (never a link out of the run dir)."""
    blobs = save_word_tokenizer(tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for path in blobs.iterdir():
        (snapshot / path.name).symlink_to(path)
    record = run_record(DataConfig(tokenizer=str(snapshot)))
    assert record["sha256"] == run_record(DataConfig(tokenizer=str(blobs)))["sha256"]
    ckpt = saved_checkpoint(tmp_path / "ckpt", record, snapshot)
    copies = sorted((ckpt / "tokenizer").iterdir())
    assert copies and not any(path.is_symlink() for path in copies)
    check_resume(ckpt, run_record(DataConfig(tokenizer=str(ckpt / "tokenizer"))), announce=True)


def test_checkpoint_of_the_old_hash_scheme_resumes_and_still_refuses_another_tokenizer(tmp_path):
    """Records written before the hash left out tokenizer_config.json hashed every file: compared
    under that scheme, the same tokenizer resumes; an edited one is still refused."""
    from megaframe.common import tokenizer_files

    tok = save_word_tokenizer(tmp_path / "tok")
    old = {k: v for k, v in run_record(DataConfig(tokenizer=str(tok))).items() if k != "hash_scheme"}
    old["sha256"] = tokenizer_files.files_hash(tok, 1)
    ckpt = saved_checkpoint(tmp_path / "ckpt", old)
    check_resume(ckpt, run_record(DataConfig(tokenizer=str(tok))), announce=True)
    swap_words(tok)
    assert "differs in its files' sha256" in refusal(ckpt, run_record(DataConfig(tokenizer=str(tok))))


def test_accept_tokenizer_change_resumes_with_one_warning_line(tmp_path, capsys):
    tok = save_word_tokenizer(tmp_path / "tok")
    ckpt = saved_checkpoint(tmp_path / "ckpt", run_record(DataConfig(tokenizer=str(tok))), tok)
    swap_words(tok)  # e.g. tokenizer.json re-serialized by another tokenizers version
    current = run_record(DataConfig(tokenizer=str(tok)))
    assert "train.resume_accept_tokenizer_change=true" in refusal(ckpt, current)
    check_resume(ckpt, current, announce=True, accept=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "train.resume_accept_tokenizer_change=true" in lines[0]
    assert "differs in its files' sha256" in lines[0]
    check_resume(ckpt, current, announce=False, accept=True)  # ranks > 0 stay quiet
    assert capsys.readouterr().err == ""
