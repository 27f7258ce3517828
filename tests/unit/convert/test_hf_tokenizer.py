"""`to-hf` ships the tokenizer the weights were trained with, usable by `AutoTokenizer` and
`pipeline("text-generation")`: a byte-level one for `byte` runs (the ids megaframe's ByteTokenizer
gives), the HF tokenizer whose files hash to the checkpoint's record otherwise, and refuses in one
line when no such copy is left. eos/bos ids and the context length go with it."""
from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch

from megaframe.checkpoint import tokenizer_record as records
from megaframe.common import tokenizer_files
from megaframe.config.schema import ModelConfig
from megaframe.convert.cli import export_hf, main
from megaframe.convert.files import write_layout_free
from megaframe.convert.hf import ConvertError
from megaframe.data.tokenizer import ByteTokenizer, HFTokenizer
from megaframe.model.factory import build_model, resolve_dims
from megaframe.model.full_state import full_state_dict
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from tests.support.word_tokenizer import TEXTS, give_own_code, save_word_tokenizer, swap_words

CONTEXT = 16
# GPT-2's learned positions end at the context: generate() past it would index out of range
GPT2 = ModelConfig(arch="gpt2", num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                   vocab_size=257, seq_length=CONTEXT)
LLAMA = ModelConfig(arch="llama", num_layers=1, hidden_size=32, num_attention_heads=2, num_kv_heads=1,
                    ffn_hidden_size=64, vocab_size=11, seq_length=CONTEXT, norm="rmsnorm", activation="swiglu",
                    position_embedding="rope")


def checkpoint(path, cfg: ModelConfig, state: dict, tokenizer_src=None):
    """A layout-free checkpoint of a random model `cfg`, its state.json holding `state`."""
    model = build_model(resolve_dims(cfg, cfg.vocab_size), ParallelState(ParallelDims(), rank=0), seed=0)
    write_layout_free(path, full_state_dict(model),
                      {"step": 1, "consumed_samples": 8, "model": dataclasses.asdict(cfg), **state},
                      tokenizer_src=tokenizer_src)
    return path


def random_texts(count: int = 40) -> list[str]:
    rng = random.Random(0)
    alphabet = "ab \n\t.é∑😀\u0301<|>endoftext"
    return ["", "<|endoftext|>", "hello world"] + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
                                                   for _ in range(count)]


def test_byte_run_exports_a_byte_level_tokenizer_with_megaframes_ids(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline

    ckpt = checkpoint(tmp_path / "ckpt", GPT2, {"tokenizer": "byte", records.RECORD_KEY: records.byte_record()})
    summary = export_hf(ckpt, tmp_path / "hf")
    assert summary.endswith("byte-level tokenizer")
    hf_tokenizer, ours = AutoTokenizer.from_pretrained(tmp_path / "hf"), ByteTokenizer()
    for text in random_texts():  # the eos token's spelling too: bytes, as ours
        assert hf_tokenizer.encode(text) == ours.encode(text), text
        assert hf_tokenizer.decode(ours.encode(text)) == text
    rng = random.Random(1)
    for _ in range(40):  # invalid UTF-8 and end-of-document ids: the same text both ways
        ids = [rng.choice([rng.randrange(256), 0xC3, 0xE2, 0xF0, 0x80, 256]) for _ in range(rng.randint(1, 12))]
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == ours.decode(ids), ids
    assert hf_tokenizer.eos_token_id == hf_tokenizer.bos_token_id == 256

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.eos_token_id == model.config.bos_token_id == 256
    assert GenerationConfig.from_pretrained(tmp_path / "hf").max_length == CONTEXT
    prompt = hf_tokenizer("To be", return_tensors="pt").input_ids
    generated = model.generate(prompt, do_sample=False)  # no length given: stops at the context, no crash
    assert generated.shape[1] <= CONTEXT and torch.equal(generated[0, :5], prompt[0])
    out = pipeline("text-generation", model=str(tmp_path / "hf"))("To be", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("To be")


def test_a_byte_runs_export_comes_back_as_a_byte_run(tmp_path, capsys):
    """Imported back, the byte-level export was an HF tokenizer: the loss was reported in bits per
    token, and a resume on the run's own byte-tokenized data was refused ("differs in kind (hf -> byte)")."""
    from megaframe.checkpoint.universal import read_state

    ckpt = checkpoint(tmp_path / "ckpt", GPT2, {"tokenizer": "byte", records.RECORD_KEY: records.byte_record()})
    export_hf(ckpt, tmp_path / "hf")
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")])
    printed = capsys.readouterr().out
    assert "megaframe's byte-level tokenizer (data.tokenizer=byte)" in printed
    assert printed.rstrip().endswith(f" data.tokenizer=byte train.resume={tmp_path / 'back'}")
    assert read_state(tmp_path / "back")[records.RECORD_KEY] == records.byte_record()
    assert not (tmp_path / "back" / "tokenizer").exists()

    swap_words(tmp_path / "hf", "a", "b")  # 257 tokens, end-of-document 256, but not the byte ids: an HF tokenizer
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "swapped")])
    assert read_state(tmp_path / "swapped")[records.RECORD_KEY]["kind"] == "hf"
    assert f"data.tokenizer={tmp_path / 'swapped' / 'tokenizer'} " in capsys.readouterr().out


def test_hf_tokenizer_run_ships_its_tokenizer_even_when_the_original_is_gone(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    tok = save_word_tokenizer(tmp_path / "tok")
    ours = HFTokenizer(tok)
    record = records.hf_record(tok, ours.vocab_size, ours.eod_id, ours.bos_id)
    ckpt = checkpoint(tmp_path / "ckpt", LLAMA, {records.RECORD_KEY: record}, tokenizer_src=tok)
    shutil.rmtree(tok)  # deleted before the export: the checkpoint's copy ships
    assert f"tokenizer from {ckpt / 'tokenizer'}" in export_hf(ckpt, tmp_path / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ours.encode(text)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.eos_token_id == ours.eod_id == 1
    out = pipeline("text-generation", model=str(tmp_path / "hf"))("the cat", max_new_tokens=3, do_sample=False)
    assert out[0]["generated_text"].startswith("the cat")


def test_export_refuses_a_tokenizer_other_than_the_recorded_one(tmp_path, capsys):
    tok = save_word_tokenizer(tmp_path / "tok")
    kept = save_word_tokenizer(tmp_path / "kept")  # the user's own copy of it
    ours = HFTokenizer(tok)
    # a checkpoint without its copy (hand-assembled, or its tokenizer/ removed with its manifest entry)
    ckpt = checkpoint(tmp_path / "ckpt", LLAMA, {records.RECORD_KEY: records.hf_record(tok, 11, ours.eod_id)})
    swap_words(tok)  # edited after training: same vocabulary, other text
    with pytest.raises(SystemExit) as code:
        main(["to-hf", str(ckpt), str(tmp_path / "hf")])
    error = capsys.readouterr().err
    assert code.value.code == 2 and error.count("\n") == 1 and error.startswith("megaframe-convert: error: ")
    assert f"{tok}: other files" in error and "--tokenizer DIR" in error
    assert not (tmp_path / "hf").exists()

    shutil.rmtree(tok)  # and deleted: still one line
    with pytest.raises(ConvertError, match=f"{tok}: no tokenizer files"):
        export_hf(ckpt, tmp_path / "hf")
    swapped = save_word_tokenizer(tmp_path / "swapped")
    swap_words(swapped)
    with pytest.raises(ConvertError, match="other files"):
        export_hf(ckpt, tmp_path / "hf", tokenizer=swapped)
    assert "tokenizer from" in export_hf(ckpt, tmp_path / "hf", tokenizer=kept)  # the right one, named by hand
    byte = checkpoint(tmp_path / "byte", GPT2, {records.RECORD_KEY: records.byte_record()})
    with pytest.raises(ConvertError, match="trained with the byte tokenizer; drop --tokenizer"):
        export_hf(byte, tmp_path / "hf-byte", tokenizer=kept)


def test_old_checkpoints_without_a_record_still_export(tmp_path):
    from transformers import AutoTokenizer

    old_byte = checkpoint(tmp_path / "byte", GPT2, {"tokenizer": "byte"})
    assert export_hf(old_byte, tmp_path / "hf-byte").endswith("byte-level tokenizer")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf-byte").encode("é") == [0xC3, 0xA9]
    tok = save_word_tokenizer(tmp_path / "tok")
    old_hf = checkpoint(tmp_path / "hf-run", LLAMA, {"tokenizer": str(tok)})
    assert "(unverified: the checkpoint predates tokenizer records)" in export_hf(old_hf, tmp_path / "hf")
    none = checkpoint(tmp_path / "none", LLAMA, {})
    assert export_hf(none, tmp_path / "hf-none").endswith("no tokenizer (the checkpoint names none)")
    assert not (tmp_path / "hf-none" / "tokenizer.json").exists()


def test_edited_record_is_refused_in_one_line(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", GPT2, {records.RECORD_KEY: {"kind": "byte"}})
    with pytest.raises(ConvertError, match="is not a tokenizer record"):
        export_hf(ckpt, tmp_path / "hf")


def test_from_hf_import_records_its_tokenizer(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megaframe.convert.cli import import_hf
    from megaframe.checkpoint.universal import read_state

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=11, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=CONTEXT)).save_pretrained(tmp_path / "hf")
    save_word_tokenizer(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "imported")
    record = read_state(tmp_path / "imported")[records.RECORD_KEY]
    assert record["name"] == str((tmp_path / "imported" / "tokenizer").resolve())
    assert (record["vocab_size"], record["eod_id"]) == (11, 1)
    assert record["sha256"] == tokenizer_files.files_hash(tmp_path / "hf")
    json.loads((tmp_path / "imported" / "tokenizer" / "tokenizer_config.json").read_text())


def test_from_hf_leaves_behind_a_tokenizer_that_needs_its_own_code(tmp_path, capsys):
    """Copied, it would be refused by every later use (training, sample, to-hf, naming a staging
    folder gone by then): the weights import, the tokenizer stays behind and the summary says why."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megaframe.checkpoint.universal import read_state

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=11, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=CONTEXT)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    marker = give_own_code(save_word_tokenizer(tmp_path / "hf"))
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "imported")])
    printed = capsys.readouterr().out
    assert "tokenizer not copied: its tokenizer_config.json names its own Python (auto_map)" in printed
    assert "data.tokenizer=" not in printed and f"train.resume={tmp_path / 'imported'}" in printed
    assert not (tmp_path / "imported" / "tokenizer").exists()
    assert records.RECORD_KEY not in read_state(tmp_path / "imported")
    assert not marker.exists(), "the tokenizer directory's Python ran"
    main(["to-hf", str(tmp_path / "imported"), str(tmp_path / "back")])  # and it exports, without a tokenizer
    assert "no tokenizer (the checkpoint names none)" in capsys.readouterr().out

    # an auto_map beside a class of transformers' own loads without the code: copied, as before (review)
    config_file = tmp_path / "hf" / "tokenizer_config.json"
    with_class = {**json.loads(config_file.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}
    config_file.write_text(json.dumps(with_class))
    main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "with-class")])
    assert "tokenizer copied to tokenizer/" in capsys.readouterr().out
    assert read_state(tmp_path / "with-class")[records.RECORD_KEY]["kind"] == "hf" and not marker.exists()


def test_to_hf_names_the_checkpoints_copy_of_a_tokenizer_that_does_not_load(tmp_path, capsys):
    """A checkpoint that holds such a copy (imported before it was left behind): refused in one line
    naming that copy, not the export's staging folder (removed by the time the user reads the line)."""
    tok = save_word_tokenizer(tmp_path / "tok")
    give_own_code(tok)
    ckpt = checkpoint(tmp_path / "ckpt", LLAMA, {records.RECORD_KEY: records.hf_record(tok, None, None)},
                      tokenizer_src=tok)
    with pytest.raises(SystemExit) as code:
        main(["to-hf", str(ckpt), str(tmp_path / "hf")])
    error = capsys.readouterr().err
    assert error == (f"megaframe-convert: error: {ckpt / 'tokenizer'}: the checkpoint's tokenizer does not load: its "
                     f"tokenizer_config.json names its own Python (auto_map), which megaframe never runs, so it cannot "
                     f"ship with the export\n") and code.value.code == 2  # no advice to write into the checkpoint
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".*hf*"))


def test_to_hf_names_no_staging_folder_when_the_tokenizer_does_not_load_here(tmp_path, capsys):
    """transformers' own text named the export's staging folder (deleted by the time the user reads
    it), and the advice was to copy a tokenizer into the checkpoint, whose manifest then fails."""
    tok = save_word_tokenizer(tmp_path / "tok")
    (tok / "tokenizer.json").write_text("{not json")  # as a tokenizer missing the package it needs fails
    ckpt = checkpoint(tmp_path / "ckpt", LLAMA, {records.RECORD_KEY: records.hf_record(tok, None, None)},
                      tokenizer_src=tok)
    with pytest.raises(SystemExit):
        main(["to-hf", str(ckpt), str(tmp_path / "hf")])
    error = capsys.readouterr().err
    assert error.startswith(f"megaframe-convert: error: {ckpt / 'tokenizer'}: the checkpoint's tokenizer does not load")
    assert ".tmp" not in error and "install what it needs to load here" in error and error.count("\n") == 1, error


def test_tampered_copy_in_the_checkpoint_is_refused(tmp_path, capsys):
    """Edited inside the checkpoint: its manifest no longer verifies (the record is not even asked)."""
    tok = save_word_tokenizer(tmp_path / "tok")
    record = records.hf_record(tok, 11, 1)
    ckpt = checkpoint(tmp_path / "ckpt", LLAMA, {records.RECORD_KEY: record}, tokenizer_src=tok)
    swap_words(ckpt / "tokenizer")
    with pytest.raises(SystemExit) as code:
        main(["to-hf", str(ckpt), str(tmp_path / "hf")])
    error = capsys.readouterr().err
    assert code.value.code == 2 and error.count("\n") == 1 and "tokenizer/tokenizer.json" in error
    assert not (tmp_path / "hf").exists()


def test_export_checks_a_record_of_the_old_hash_scheme_under_it(tmp_path):
    """A checkpoint whose record hashed every tokenizer file (before tokenizer_config.json was left
    out) still exports its own tokenizer; an edited copy is still refused."""
    from megaframe.convert.tokenizer_export import hf_tokenizer_source

    tok = save_word_tokenizer(tmp_path / "tok")
    old = {"kind": "hf", "name": str(tok), "vocab_size": 11, "eod_id": 1, "bos_id": None,
           "sha256": tokenizer_files.files_hash(tok, 1)}
    assert hf_tokenizer_source(tmp_path / "ckpt", old, None)[0] == tok
    swap_words(tok)
    with pytest.raises(ConvertError, match="no copy of the tokenizer"):
        hf_tokenizer_source(tmp_path / "ckpt", old, None)
