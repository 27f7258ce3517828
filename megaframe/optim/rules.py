"""optim's rules, checked before launch (backends/registry.py hands them to validate() with the
engine's): the optimizer's name and keys, and the layouts an optimizer steps correctly. Muon's
Newton-Schulz needs each matrix whole; megaframe assembles a matrix FSDP2 shards over data-parallel
ranks on one owner (optim/sharded.py); every other layout that splits one is refused here, in one
line naming the key (docs/optimizers.md)."""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Optional

from megaframe.config.choices import choice_problem
from megaframe.config.schema import MuonConfig, TrainConfig
from megaframe.optim.table import TENSOR_STATE

NAMES = tuple(TENSOR_STATE)
ADJUST_LR = ("spectral", "match_rms_adamw")  # optim.muon.adjust_lr (optim/muon.py's adjusted_lr)


def _finite(value, low: float, strict: bool) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and (value > low if strict else value >= low)


def optim_problem(cfg: TrainConfig) -> Optional[str]:
    """optim.name and, under optim=muon, optim.muon's keys; a Muon key set under another optimizer
    (which would read nothing of it) too."""
    o, m = cfg.optim, cfg.optim.muon
    if err := choice_problem("optim.name", o.name, NAMES):
        return f"{err} (optim=adamw or optim=muon)"
    if o.name != "muon":
        default = MuonConfig()
        changed = [f.name for f in fields(MuonConfig) if getattr(m, f.name) != getattr(default, f.name)]
        if changed:
            return (f"optim.muon.{changed[0]} is read only under optim=muon, and this run's optimizer is "
                    f"optim.name={o.name}: select optim=muon, or drop the key")
        return None
    if err := choice_problem("optim.muon.adjust_lr", m.adjust_lr, ADJUST_LR):
        return err
    if not (_finite(m.momentum, 0, False) and m.momentum < 1):
        return f"optim.muon.momentum={m.momentum} must be in [0, 1), e.g. 0.95"
    if not 1 <= m.ns_steps < 100:
        return f"optim.muon.ns_steps={m.ns_steps} must be in [1, 99], e.g. 5"
    if len(m.ns_coefficients) != 3 or not all(_finite(c, -math.inf, False) for c in m.ns_coefficients):
        return (f"optim.muon.ns_coefficients={list(m.ns_coefficients)} must be three finite numbers (a, b, c), "
                f"e.g. [3.4445,-4.775,2.0315]")
    for key, value, strict in (("eps", m.eps, True), ("adamw_lr", m.adamw_lr, True),
                               ("adamw_weight_decay", m.adamw_weight_decay, False)):
        if value is not None and not _finite(value, 0, strict):
            return f"optim.muon.{key}={value} must be a finite number {'>' if strict else '>='} 0"
    return None


def optim_layout_problem(cfg: TrainConfig, layout, on_tensors: bool) -> Optional[str]:
    """Muon only where it sees each matrix whole or as a DTensor's row shard it can assemble
    (optim/sharded.py): an engine whose optimizer steps parameter tensors (on_tensors: FSDP2, or the
    plain engine standing in for DeepSpeed's at one process), over data-parallel ranks only,
    nothing offloaded. The rest is refused, naming the key."""
    if cfg.optim.name != "muon":
        return None
    if not on_tensors:
        return (f"optim=muon with backend={cfg.backend.name}: its ZeRO and mixed-precision optimizers step flattened "
                f"partitions, not whole matrices; use backend=fsdp2, or one process at zero=stage0 precision=fp32 "
                f"without offload")
    for axis in ("tp", "pp", "cp", "ep", "dp_replicate"):
        degree = getattr(layout.grid, axis)
        if degree > 1:
            return (f"optim=muon with parallel.{axis}={degree}: Newton-Schulz needs whole matrices, which megaframe "
                    f"assembles only across data-parallel ranks so far; use parallel.{axis}=1, or optim=adamw")
    for key in ("optimizer", "param"):
        if getattr(cfg.offload, key) != "none":
            return (f"optim=muon with offload.{key}={getattr(cfg.offload, key)}: Muon does not step offloaded "
                    f"state yet; use offload=none, or optim=adamw")
    return None
