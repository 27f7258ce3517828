"""The vocabulary a dataset's sidecar (PREFIX.json) records, read before launch by validation and the
planner. A damaged sidecar (not JSON, not an object, a vocab_size that is not a whole number) was a
JSONDecodeError or AttributeError traceback there, before the data reader, which checks the whole
file (data/indexed.py), could say so in one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megaframe.common import json_text
from megaframe.common.safe_files import UnsafeFile, read_capped
from megaframe.config.sidecar_fields import field_problem

_REBUILD = "rebuild it with megaframe-preprocess"
# a sidecar is metadata (its longest part the list of source files: a few MB for 100k of them);
# a larger file is not one, and is not read whole into memory before launch
MAX_SIDECAR_BYTES = 64 << 20


class SidecarError(ValueError):
    """PREFIX.json cannot be read as a sidecar; str(err) is one line naming the file."""


def recorded_vocab_size(prefix: str) -> Optional[int]:
    """The vocab_size PREFIX.json records; None without a sidecar or without the field."""
    recorded = _recorded(prefix)
    vocab = None if recorded is None else recorded.get("vocab_size")
    if vocab is None:
        return None
    # the data reader's checks of these fields, before the planner sizes a model of 10^12 rows
    vocabulary = {key: recorded[key] for key in ("tokenizer", "vocab_size", "eod_id") if key in recorded}
    if problem := field_problem(vocabulary):
        raise SidecarError(f"{prefix}.json: {problem} (damaged or edited); {_REBUILD}")
    return vocab


def document_ends_problem(prefix: str) -> Optional[str]:
    """Why PREFIX's tokens carry no end-of-document token to cut documents at (its sidecar records
    no eod_id, or a build with --no-append-eod), or None; a dataset without a sidecar takes the
    tokenizer's eod_id."""
    recorded = _recorded(prefix)
    if recorded is None:
        return None
    if "eod_id" in recorded and recorded["eod_id"] is None:
        return f"{prefix}.json records no end-of-document id"
    if recorded.get("append_eod") is False:
        return f"{prefix} was built with --no-append-eod: its documents carry no end-of-document token"
    return None


def _recorded(prefix: str) -> Optional[dict]:
    """PREFIX.json's object; None without a sidecar; SidecarError, one line, when it is no sidecar."""
    meta = Path(prefix + ".json")
    if not meta.is_file():
        return None
    try:
        # the user's own data directory: a link they made is followed (resolve), but what it ends in must
        # be a regular file of sidecar size (a FIFO would hang validation, a huge file fill the memory)
        recorded = json_text.loads(read_capped(meta.resolve(), MAX_SIDECAR_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        what = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8"
        raise SidecarError(f"{meta} is not valid JSON ({what} at byte "
                           f"{getattr(err, 'pos', getattr(err, 'start', '?'))}); {_REBUILD}") from None
    except UnsafeFile as err:
        raise SidecarError(f"{err.strerror}; {_REBUILD}") from None
    except OSError as err:
        raise SidecarError(f"{meta}: cannot read it ({err.strerror}); {_REBUILD}") from None
    if not isinstance(recorded, dict):
        raise SidecarError(f"{meta} must hold a JSON object; {_REBUILD}")
    return recorded
