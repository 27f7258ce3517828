"""A run with a Hugging Face tokenizer, through the real trainer: its checkpoint records the
tokenizer; a resume with the same one goes on, a resume with an edited one of the same vocabulary
size is refused (one line naming data.tokenizer, exit 5); the export loads in `AutoTokenizer` and
runs in `pipeline("text-generation")` with the tokenizer the weights were trained with."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from tests.support.helpers import TINY
from megaframe.checkpoint.tokenizer_record import RECORD_KEY
from megaframe.common.tokenizer_files import files_hash
from megaframe.convert.cli import export_hf
from megaframe.data.preprocess import preprocess
from megaframe.data.tokenizer import HFTokenizer
from tests.support.ranks import run_ranks
from tests.support.word_tokenizer import corpus, save_word_tokenizer, swap_words

pytestmark = pytest.mark.slow


def train_resume_and_switch(rank: int, world: int, run_dir: str, data: str, tok: str, edited: str,
                            edited_data: str) -> dict:
    """Two steps, a resume with the same tokenizer to step 3, then one with the edited copy and the
    text tokenized by it (the data alone is then consistent: only the checkpoint's record tells)."""
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.failure_report import report_failure
    from megaframe.training.trainer import Trainer

    def config(tokenizer: str, steps: int, path: str = data):
        cfg, _ = compose([*TINY, f"data.path={path}", f"data.tokenizer={tokenizer}", f"train.max_steps={steps}",
                          "train.eval_interval=0"])
        return cfg, validate_for_engine(cfg, world, ask_bf16=False)

    with Trainer(*config(tok, 2), Path(run_dir)) as trainer:
        trainer.fit()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out):
        with Trainer(*config(tok, 3), Path(run_dir)) as trainer:
            trainer.fit()
    code = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:  # what train() does, short of ending the process group the test's ranks share
            with Trainer(*config(edited, 4, edited_data), Path(run_dir)) as refused:
                refused.fit()
        except Exception as error:  # noqa: BLE001 - reported as megaframe-train reports it
            code = report_failure(error, Path(run_dir), rank)
    return {"resumed": out.getvalue(), "code": code, "stderr": err.getvalue(), "step": trainer.step}


def test_hf_tokenizer_run_is_recorded_guarded_on_resume_and_exported(tmp_path):
    from transformers import AutoTokenizer, pipeline

    tok = save_word_tokenizer(tmp_path / "tok")
    edited = tmp_path / "edited"
    shutil.copytree(tok, edited)
    swap_words(edited)  # same 11 tokens and eos, other text
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus()))
    preprocess([tmp_path / "docs.jsonl"], tmp_path / "data", str(tok), progress=False)
    preprocess([tmp_path / "docs.jsonl"], tmp_path / "edited_data", str(edited), progress=False)
    run = tmp_path / "run"
    [result] = run_ranks(train_resume_and_switch, 1, tmp_path, run_dir=str(run), data=str(tmp_path / "data"),
                         tok=str(tok), edited=str(edited), edited_data=str(tmp_path / "edited_data"))

    assert "resumed from" in result["resumed"] and result["step"] == 3  # the same tokenizer goes on
    assert result["code"] == 5
    lines = [line for line in result["stderr"].splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in result["stderr"]
    assert f"data.tokenizer={edited}" in lines[0] and "differs in its files' sha256" in lines[0]
    latest = run / "checkpoints" / "global_step3"
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step3"  # nothing saved by the refusal
    record = json.loads((latest / "state.json").read_text())[RECORD_KEY]
    assert record["kind"] == "hf" and record["sha256"] == files_hash(tok) == files_hash(latest / "tokenizer")

    shutil.rmtree(tok)  # the export ships the checkpoint's copy
    export_hf(run / "checkpoints", tmp_path / "hf")
    hf_tokenizer, ours = AutoTokenizer.from_pretrained(tmp_path / "hf"), HFTokenizer(latest / "tokenizer")
    text = corpus(1)[0]
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ours.encode(text)
    generated = pipeline("text-generation", model=str(tmp_path / "hf"))("the cat", max_new_tokens=4, do_sample=False)
    assert generated[0]["generated_text"].startswith("the cat")
