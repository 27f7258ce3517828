"""The sha256 of a file, for checkpoint manifests and tokenizer records: a leaf both import (the
manifest writer, universal.py, imports the tokenizer record, so the record cannot import it)."""
from __future__ import annotations

import hashlib
from pathlib import Path


def hash_file(path: Path) -> str:
    """The sha256 of a file's content (hex), read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
