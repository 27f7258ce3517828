"""A saved Hugging Face tokenizer's files and the sha256 that names them: what a checkpoint's tokenizer
record and a dataset's sidecar (PREFIX.json) both hold, so a leaf both import (data/ may not import
checkpoint/). Two tokenizers with one vocabulary size and end-of-document id can map the same ids to
other text: only the files tell them apart.

The hash covers what defines the mapping of ids to text (HASH_SCHEMES): scheme 1, of checkpoints
written before, also hashed tokenizer_config.json and special_tokens_map.json, which save_pretrained
rewrites with keys of its own version, so re-saving the same tokenizer changed it."""
from __future__ import annotations

import hashlib
from pathlib import Path

from megaframe.common.file_hash import hash_file

# what save_pretrained() writes for a tokenizer (any of these marks a directory as holding one);
# only these are copied into a checkpoint and exported (a model directory's weights are not); which of
# them are hashed: HASH_SCHEMES
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
MAX_TOKENIZER_FILE = 1 << 30  # a tokenizer file is MBs; a larger one is not a tokenizer (and is not read)
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


def identity(directory: Path) -> tuple[str, str, int]:
    """What a record of the tokenizer in `directory` names it by: its full path, its files' sha256 and
    the hash scheme (a checkpoint's tokenizer record, a dataset's sidecar); OSError as files_hash."""
    return str(Path(directory).resolve()), files_hash(directory), HASH_SCHEME


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
