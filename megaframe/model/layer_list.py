"""The layer list every builder walks, as data: embed | block x num_layers | final_norm | head. Its
own file (no torch, no model import) so that the GPT, which builds its layers from it, and ModelSpec,
which reads the GPT's parameters, do not import each other."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional


@dataclass(frozen=True)
class Layer:
    """One entry of the layer list: its kind, the canonical prefix of its parameters, its block."""

    kind: str  # embed | block | final_norm | head
    prefix: str  # embed, blocks.{i}, final_norm, head; a tied head is the embedding again
    block: Optional[int] = None


# The planner's layout search asks for the list of the same model thousands of times.
@lru_cache(maxsize=64)
def layer_list(num_layers: int, tied: bool) -> tuple[Layer, ...]:
    return (Layer("embed", "embed"), *[Layer("block", f"blocks.{i}", i) for i in range(num_layers)],
            Layer("final_norm", "final_norm"), Layer("head", "embed" if tied else "head"))
