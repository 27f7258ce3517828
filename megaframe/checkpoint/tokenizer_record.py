"""Which tokenizer a checkpoint's weights were trained with.

Every checkpoint carries a record of it (the client state, and state.json of a layout-free copy):

  {"kind": "byte" | "hf", "name": "byte" or the directory, "vocab_size": V, "eod_id": E,
   "bos_id": B or None, "sha256": a hash of the tokenizer's files (a constant for byte),
   "hash_scheme": 2 (hf only; absent: 1)}

The hash and the files it covers: common/tokenizer_files.py (a dataset's sidecar records it too). A
record is compared under its own scheme (rehashed), so an old checkpoint is not refused for the change
of scheme.

Resume compares it with the run's data.tokenizer (two tokenizers with one vocabulary size map the
same ids to different text: the weights would silently learn another language), and the Hugging
Face export ships only a tokenizer whose files hash to it. Plain Python: no transformers here.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from megaframe.common.tokenizer_files import HASH_SCHEME, HASH_SCHEMES, files_hash, identity

RECORD_KEY = "tokenizer_record"
# the byte tokenizer has no files: its hash names what it computes, so a future change to it is a new hash
BYTE_SPEC = "megaframe byte tokenizer: UTF-8 bytes as ids 0..255, end-of-document 256"
# compared in this order: the first difference is the one a refusal names
FIELDS = ("kind", "vocab_size", "eod_id", "bos_id", "sha256")


def scheme_of(record: dict) -> int:
    """The hash scheme of a record: 1 for one written before records named theirs."""
    scheme = record.get("hash_scheme", 1)
    known = isinstance(scheme, int) and not isinstance(scheme, bool) and scheme in HASH_SCHEMES
    return scheme if known else HASH_SCHEME  # state.json is a file a user can edit


def under_scheme(current: dict, saved: dict) -> dict:
    """`current` (an hf record of this run) with its hash recomputed under `saved`'s scheme, so the
    two compare; `current` itself when the schemes agree or either is not an hf record. OSError when
    the directory cannot be read again."""
    scheme = scheme_of(saved)
    if current.get("kind") != "hf" or saved.get("kind") != "hf" or scheme == scheme_of(current):
        return current
    return {**current, "sha256": files_hash(Path(current["name"]), scheme), "hash_scheme": scheme}


def byte_record() -> dict[str, Any]:
    """The record of megaframe's built-in byte tokenizer."""
    return {"kind": "byte", "name": "byte", "vocab_size": 257, "eod_id": 256, "bos_id": None,
            "sha256": hashlib.sha256(BYTE_SPEC.encode()).hexdigest()}


def hf_record(directory: Path, vocab_size: Optional[int], eod_id: Optional[int],
              bos_id: Optional[int] = None) -> dict[str, Any]:
    """The record of the HF tokenizer saved in `directory` (None: not known)."""
    name, sha256, scheme = identity(directory)
    return {"kind": "hf", "name": name, "vocab_size": vocab_size, "eod_id": eod_id, "bos_id": bos_id,
            "sha256": sha256, "hash_scheme": scheme}


def difference(saved: dict, current: dict) -> Optional[tuple[str, Any, Any]]:
    """(field, saved value, current value) of the first field the two records give and disagree on."""
    for field in FIELDS:
        was, now = saved.get(field), current.get(field)
        if was is not None and now is not None and was != now:
            return field, was, now
    return None


def describe(record: dict) -> str:
    """'byte (vocabulary 257, end-of-document 256)', or the HF directory with its ids."""
    if record.get("kind") == "byte":
        return "byte (vocabulary 257, end-of-document 256)"
    ids = [f"vocabulary {record.get('vocab_size')}", f"end-of-document {record.get('eod_id')}"]
    if record.get("bos_id") is not None:
        ids.append(f"bos {record['bos_id']}")
    return f"{record.get('name')} ({', '.join(ids)})"


def is_record(value: Any) -> bool:
    """Whether `value` has the shape of a record (state.json is a file a user can edit)."""
    return isinstance(value, dict) and value.get("kind") in ("byte", "hf") and isinstance(value.get("sha256"), str)
