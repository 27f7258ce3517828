"""Which tokenizer a checkpoint's weights were trained with.

Every checkpoint carries a record of it (the client state, and state.json of a layout-free copy):

  {"kind": "byte" | "hf", "name": "byte" or the directory, "vocab_size": V, "eod_id": E,
   "bos_id": B or None, "sha256": a hash of the tokenizer's files (a constant for byte),
   "hash_scheme": 2 (hf only; absent: 1)}

The hash covers what defines the mapping of ids to text (HASH_SCHEMES): scheme 1, of checkpoints
written before, also hashed tokenizer_config.json and special_tokens_map.json, which save_pretrained
rewrites with keys of its own version, so re-saving the same tokenizer changed it. A record is
compared under its own scheme (rehashed), so an old checkpoint is not refused for the change of scheme.

Resume compares it with the run's data.tokenizer (two tokenizers with one vocabulary size map the
same ids to different text: the weights would silently learn another language), and the Hugging
Face export ships only a tokenizer whose files hash to it. Plain Python: no transformers here.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from megaframe.checkpoint.file_hash import hash_file

RECORD_KEY = "tokenizer_record"
# what save_pretrained() writes for a tokenizer (any of these marks a directory as holding one);
# only these are copied into a checkpoint and exported (a model directory's weights are not); which of
# them are hashed: HASH_SCHEMES
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
MAX_TOKENIZER_FILE = 1 << 30  # a tokenizer file is MBs; a larger one is not a tokenizer (and is not read)
# the byte tokenizer has no files: its hash names what it computes, so a future change to it is a new hash
BYTE_SPEC = "megaframe byte tokenizer: UTF-8 bytes as ids 0..255, end-of-document 256"
# compared in this order: the first difference is the one a refusal names
FIELDS = ("kind", "vocab_size", "eod_id", "bos_id", "sha256")
# the files each hash scheme covers. 2: the vocabulary, merges and added tokens (the special ids are
# record fields of their own); a tokenizer.json, where there is one, holds all of them and is what
# transformers loads, so the slow tokenizer's files beside it (present or not by version) do not count
HASH_SCHEMES = {1: TOKENIZER_FILES, 2: ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
                                        "added_tokens.json")}
HASH_SCHEME = 2  # what new records use


def tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer files directly in `directory`, by their fixed names (a Hugging Face cache's
    snapshot links them to its blobs: followed, and copied as plain files)."""
    directory = Path(directory)
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` holds a saved HF tokenizer."""
    return bool(tokenizer_files(directory))


def files_hash(directory: Path, scheme: int = HASH_SCHEME) -> str:
    """sha256 over the files of `directory` that hash scheme `scheme` covers (name and sha256 of
    each, in a fixed order); OSError when one cannot be read or is larger than a tokenizer file can be."""
    directory = Path(directory)
    names = HASH_SCHEMES[scheme]
    if scheme >= 2 and (directory / "tokenizer.json").is_file():
        names = ("tokenizer.json",)
    digest = hashlib.sha256()
    for path in (directory / name for name in names if (directory / name).is_file()):
        if path.stat().st_size > MAX_TOKENIZER_FILE:
            raise OSError(f"{path} is {path.stat().st_size} bytes, not a tokenizer file")
        digest.update(f"{path.name}\0{hash_file(path)}\n".encode())
    return digest.hexdigest()


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
    return {"kind": "hf", "name": str(Path(directory).resolve()), "vocab_size": vocab_size, "eod_id": eod_id,
            "bos_id": bos_id, "sha256": files_hash(directory), "hash_scheme": HASH_SCHEME}


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
