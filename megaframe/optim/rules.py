"""The optimizer seam's rule before launch (backends/registry.py hands it to validate() with the
engine's): the layouts an optimizer steps correctly (its keys: config/optim_rules.py). Muon's
Newton-Schulz needs each matrix whole; megaframe assembles a matrix FSDP2 shards (dp, cp, HSDP's
shard group, an expert's edp ranks) or tensor parallelism splits on one owner (optim/pieces.py,
sharded.py), at any tp, pp, cp, ep; what it cannot step is refused here, in one line naming the key
(docs/optimizers.md)."""
from __future__ import annotations

from typing import Optional

from megaframe.config.schema import TrainConfig


def optim_layout_problem(cfg: TrainConfig, layout, on_tensors: bool) -> Optional[str]:
    """Muon only where it sees each matrix whole or as pieces it can assemble (optim/pieces.py): an
    engine whose optimizer steps parameter tensors (on_tensors: FSDP2 in any layout, or the plain
    engine standing in for DeepSpeed's at one process), nothing offloaded. The rest is refused,
    naming the key."""
    if cfg.optim.name != "muon":
        return None
    if not on_tensors:
        return (f"optim=muon with backend={cfg.backend.name}: its ZeRO and mixed-precision optimizers step flattened "
                f"partitions, not whole matrices; use backend=fsdp2, or one process at zero=stage0 precision=fp32 "
                f"without offload")
    for key in ("optimizer", "param"):
        if getattr(cfg.offload, key) != "none":
            return (f"optim=muon with offload.{key}={getattr(cfg.offload, key)}: Muon does not step offloaded "
                    f"state yet; use offload=none, or optim=adamw")
    return None
