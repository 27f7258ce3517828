"""The one-line refusal of a value that is not among a key's choices."""
from __future__ import annotations

from typing import Iterable, Optional


def choice_problem(key: str, value, allowed: Iterable) -> Optional[str]:
    """None when value is one of allowed, else the one-line refusal naming key."""
    allowed = list(allowed)
    if value not in allowed:
        return f"{key}={value!r} is not one of {allowed}"
    return None
