"""The fields of megaframe's dataset sidecar (PREFIX.json), checked by type before any is used.

A sidecar edited by hand or damaged on copy (a string vocab_size, a checksum that is not hex) used
to end in a ValueError traceback, or, worse, be read as something else (int("300") is a valid
vocabulary). Both the MFTOKIDX and the Megatron sidecar go through this one check."""
from __future__ import annotations

import string
from typing import Any, Optional

import numpy as np

from megaframe.common.tokenizer_files import HASH_SCHEMES

_COUNTS = ("num_documents", "num_tokens", "index_bytes")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and len(value) % 2 == 0 and set(value) <= set(string.hexdigits)


# the byte tokenizer's vocabulary and end-of-document id (tokenizer.py's ByteTokenizer, which imports
# this package's indexed.py: not imported here)
BYTE_VOCAB = (257, 256)


def field_problem(sidecar: dict[str, Any], dtype: Optional[np.dtype] = None) -> Optional[str]:
    """What is wrong with the sidecar's fields, naming the first, or None. Absent fields are the
    caller's business (each format requires its own). `dtype`: the tokens' on-disk type, whose ids
    bound the vocabulary (a vocab_size edited from 257 to 100000 beside uint16 tokens built a model
    of 100,000 rows and trained it, exit 0)."""
    if "tokenizer" in sidecar and not isinstance(sidecar["tokenizer"], str):
        return f"its tokenizer is {sidecar['tokenizer']!r}, not a name or a directory"
    vocab = sidecar.get("vocab_size")
    if vocab is not None and not (_is_int(vocab) and vocab >= 1):
        return f"its vocab_size is {vocab!r}, not a whole number >= 1"
    eod = sidecar.get("eod_id")
    if eod is not None and not (_is_int(eod) and 0 <= eod < (vocab if _is_int(vocab) else eod + 1)):
        return f"its eod_id is {eod!r}, not a token id below vocab_size={vocab}"
    if sidecar.get("tokenizer") == "byte" and _is_int(vocab) and _is_int(eod) and (vocab, eod) != BYTE_VOCAB:
        return (f"it names the byte tokenizer but records vocab_size={vocab}, eod_id={eod} (the byte tokenizer's "
                f"are {BYTE_VOCAB[0]} and {BYTE_VOCAB[1]})")
    widest = np.dtype(dtype if dtype is not None and np.issubdtype(dtype, np.integer) else np.int32)
    if _is_int(vocab) and vocab > int(np.iinfo(widest).max) + 1:  # megaframe writes uint16 or int32 tokens
        return f"its vocab_size is {vocab}, more ids than its {widest.name} tokens can hold"
    for key in ("checksum", "tokenizer_sha256"):
        if sidecar.get(key) is not None and not _is_hex(sidecar[key]):
            return f"its {key} is {sidecar[key]!r}, not hexadecimal"
    scheme = sidecar.get("tokenizer_hash_scheme")
    if sidecar.get("tokenizer_sha256") is not None and not (_is_int(scheme) and scheme in HASH_SCHEMES):
        return f"its tokenizer_hash_scheme is {scheme!r}, not one of {sorted(HASH_SCHEMES)}"
    for key in _COUNTS:
        if key in sidecar and not (_is_int(sidecar[key]) and sidecar[key] >= 0):
            return f"its {key} is {sidecar[key]!r}, not a whole number >= 0"
    return None
