"""The run's tokenizer record (checkpoint/tokenizer_record.py): made once per run, saved with every
checkpoint, and compared on resume. Another tokenizer with the same vocabulary size maps the same
ids to other text, which nothing downstream notices: the weights would be trained on a new language
and exported with the wrong tokenizer. Refused in one line naming data.tokenizer (exit 5)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from megaframe.checkpoint import tokenizer_record as records
from megaframe.checkpoint import universal
from megaframe.checkpoint.universal import CheckpointError
from megaframe.common.tokenizer_files import has_tokenizer
from megaframe.config.schema import DataConfig
from megaframe.data.indexed import DataError

RECORD_KEY = records.RECORD_KEY
__all__ = ["RECORD_KEY", "run_record", "check_resume"]


def run_record(data: DataConfig) -> dict:
    """The record of data.tokenizer: the byte tokenizer's constant one, or an HF directory's ids and
    files' hash (the directory is loaded as the data pipeline loads it, never its own code)."""
    if data.tokenizer == "byte":
        return records.byte_record()
    from megaframe.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(data.tokenizer)  # DataError (exit 4) naming data.tokenizer when it does not load
    try:
        return records.hf_record(Path(data.tokenizer), tokenizer.vocab_size, tokenizer.eod_id, tokenizer.bos_id)
    except OSError as err:
        raise DataError(f"data.tokenizer={data.tokenizer}: cannot read its tokenizer files ({err})") from None


def check_resume(path: Path, current: dict, announce: bool, client_state: Optional[dict] = None,
                 accept: bool = False) -> None:
    """Refuse to resume checkpoint `path` with another tokenizer than the one it records; with
    `accept` (train.resume_accept_tokenizer_change) say so in one warning line instead.

    client_state: the loaded client state; without it the check reads the layout-free state.json
    (before any tensor is read) and returns when there is none (an engine-only checkpoint: checked
    again once loaded). A checkpoint written before records resumes with one line saying so."""
    if client_state is None:
        if not universal.has_universal(path):
            return
        client_state = universal.read_state(path)
    saved = client_state.get(records.RECORD_KEY)
    if saved is None:
        if announce:
            print(f"megaframe: note: checkpoint {path} records no tokenizer (written before checkpoints "
                  f"did, or imported from a model directory without one): "
                  f"resuming without checking data.tokenizer against it", file=sys.stderr, flush=True)
        return
    if not records.is_record(saved):
        raise CheckpointError(f"train.resume: checkpoint {path}: its {records.RECORD_KEY} is not a tokenizer record "
                              f"(state.json was edited); resume from another checkpoint with train.resume=PATH")
    try:
        current = records.under_scheme(current, saved)  # a checkpoint of an earlier hash scheme: compared under it
    except OSError as err:
        raise CheckpointError(f"train.resume: data.tokenizer={current.get('name')}: cannot read its tokenizer files "
                              f"again ({err})") from None
    change = records.difference(saved, current)
    if change is None:
        return
    field, was, now = change
    if field == "sha256":
        was, now = was[:12], now[:12]
    if accept:
        if announce:
            print(f"megaframe: warning: train.resume_accept_tokenizer_change=true: checkpoint {path} was trained with "
                  f"data.tokenizer={records.describe(saved)}; continuing with {records.describe(current)} (differs in "
                  f"{_FIELD_NAMES[field]}: {was} -> {now})", file=sys.stderr, flush=True)
        return
    copy = Path(path) / "tokenizer"
    fix = (f"data.tokenizer={copy} (the checkpoint's copy)" if saved["kind"] == "hf" and has_tokenizer(copy)
           else f"data.tokenizer={saved.get('name')}")
    raise CheckpointError(
        f"train.resume: checkpoint {path} was trained with data.tokenizer={records.describe(saved)}; this run's "
        f"data.tokenizer={records.describe(current)} differs in {_FIELD_NAMES[field]} ({was} -> {now}) and would "
        f"train the weights on other text: set {fix}, start a new run (train.resume=none or another hydra.run.dir), "
        f"or, if it maps the same ids to the same text, accept it with train.resume_accept_tokenizer_change=true")


_FIELD_NAMES = {"kind": "kind", "vocab_size": "vocabulary size", "eod_id": "end-of-document id",
                "bos_id": "bos id", "sha256": "its files' sha256"}
