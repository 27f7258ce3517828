"""data.blend's form, Megatron's order [w1, prefix1, w2, prefix2, ...], checked before launch (here,
where config validation can use it) and parsed again by the data path (megaframe/data/blend.py)."""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["parse_blend"]


def parse_blend(blend: Sequence, key: str = "data.blend") -> tuple[list[float], list[str]]:
    """Megatron's order, [w1, prefix1, w2, prefix2, ...] (a lone prefix is weight 1), as (weights, prefixes)."""
    items = list(blend)
    if len(items) == 1 and isinstance(items[0], str):
        return [1.0], [items[0]]
    if not items or len(items) % 2:
        raise ValueError(f"{key}={items}: expected weights and prefixes in pairs, e.g. {key}='[0.3,/data/a,0.7,/data/b]'")
    weights, prefixes = items[0::2], items[1::2]
    for weight, prefix in zip(weights, prefixes):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{key}: weight {weight!r} (of {prefix}) must be a number >= 0; "
                             f"write weights and prefixes in pairs, e.g. {key}='[0.3,/data/a,0.7,/data/b]'")
        if not isinstance(prefix, str):
            raise ValueError(f"{key}: {prefix!r} (after weight {weight}) must be a dataset prefix (PREFIX of "
                             f"PREFIX.bin/.idx)")
    if sum(weights) <= 0:
        raise ValueError(f"{key}: the weights sum to 0; give at least one source a positive weight")
    if not math.isfinite(sum(weights)):  # 1.5e308 + 0.5e308: every share 0 / inf, an equal split after
        raise ValueError(f"{key}: the weights sum past the largest float; scale them down (only their ratios count)")
    return [float(w) for w in weights], list(prefixes)
