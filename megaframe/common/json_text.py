"""json.loads for files a user or a crash can have damaged.

JSON nested deeper than the interpreter's stack (a line of 100,000 `[`, 100 KB) makes json.loads
raise RecursionError, which no reader's `except json.JSONDecodeError` caught: a traceback from
megaframe-preprocess, -train, -plan and -eval alike. Here it is a JSONDecodeError like any other
malformed JSON, so each reader's one line (naming its file) covers it.
"""
from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    """json.loads(text); nesting too deep is a JSONDecodeError ("nested too deeply")."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None
