"""The optimizer seam's rule before launch (backends/registry.py hands it to validate() with the
engine's): the layouts an optimizer steps correctly (its keys: config/optim_rules.py). Muon's
Newton-Schulz needs each matrix whole; megaframe assembles on one owner (optim/pieces.py,
sharded.py) a matrix FSDP2 shards (dp, cp, HSDP's shard group, an expert's edp ranks) or tensor
parallelism splits, at any tp, pp, cp, ep, and a matrix DeepSpeed ZeRO-1/2/3 cuts into flat
partitions over its data-parallel group (dp x cp; an expert's edp ranks), at any tp (ranges of TP
pieces, over tp x that group), pp (each stage's own), cp and ep; what it cannot step is refused
here, in one line naming the key (docs/optimizers.md)."""
from __future__ import annotations

from typing import Optional

from megaframe.config.schema import TrainConfig


def optim_layout_problem(cfg: TrainConfig, on_tensors: bool,
                         described_stages: tuple[int, ...] = ()) -> Optional[str]:
    """Muon only where it sees each matrix whole or in pieces it can assemble (optim/pieces.py): an
    engine whose optimizer steps parameter tensors (on_tensors: FSDP2 in any layout, or the plain
    engine standing in for DeepSpeed's at one process), or a ZeRO stage whose flat partitions the
    engine describes (described_stages: DeepSpeed's 1-3); nothing offloaded. The rest is refused,
    naming the key."""
    if cfg.optim.name != "muon":
        return None
    described = not on_tensors and cfg.zero.stage in described_stages
    if not on_tensors and not described:
        return (f"optim=muon with backend={cfg.backend.name}: its ZeRO and mixed-precision optimizers step flattened "
                f"partitions, not whole matrices; megaframe locates matrices in them at zero=stage1, stage2 and "
                f"stage3 only (zero.stage={cfg.zero.stage}); use zero=stage1, backend=fsdp2, or one process at "
                f"zero=stage0 precision=fp32 without offload")
    for key in ("optimizer", "param"):
        if getattr(cfg.offload, key) != "none":
            return (f"optim=muon with offload.{key}={getattr(cfg.offload, key)}: Muon does not step offloaded "
                    f"state yet; use offload=none, or optim=adamw")
    return None
