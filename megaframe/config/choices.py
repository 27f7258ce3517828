"""The one-line refusal of a value that is not among a key's choices, and of keys set for a feature
that is off."""
from __future__ import annotations

from dataclasses import fields
from typing import Iterable, Optional


def choice_problem(key: str, value, allowed: Iterable) -> Optional[str]:
    """None when value is one of allowed, else the one-line refusal naming key."""
    allowed = list(allowed)
    if value not in allowed:
        return f"{key}={value!r} is not one of {allowed}"
    return None


def unread_key(section, prefix: str, switch: str, why: str) -> Optional[str]:
    """The refusal of the first key of `section` (a config dataclass) set away from its default while
    its feature is off: such a key was ignored in silence (precision.fp8.recipe=mxfp8 without
    precision=fp8 trained in bf16, exit 0). `switch`: the field that turns the feature on, left out;
    `why`: how to turn it on, e.g. "precision=fp8 (precision.fp8.enabled=true)"."""
    if changed := first_changed(section, switch):
        return f"{prefix}.{changed} is read only with {why}, which this run does not use: set it, or drop the key"
    return None


def first_changed(section, switch: str = "") -> Optional[str]:
    """The first field of `section` (a config dataclass), `switch` left out, set away from its default."""
    default = type(section)()
    return next((f.name for f in fields(section)
                 if f.name != switch and getattr(section, f.name) != getattr(default, f.name)), None)
