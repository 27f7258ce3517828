"""Each optimizer's per-parameter state, by name: the tensors it keeps for every parameter it steps
(each shaped like that parameter, fp32) and whether it keeps a step count. The layout-free
checkpoint stores a parameter's state as KEY.NAME for each key here; memory accounting and the
planner count these tensors. A new optimizer adds one row (and an optimizer name a parameter group
carries under "optimizer").

No imports of megaframe: the checkpoint format reads this table."""
from __future__ import annotations

from typing import Mapping

# optimizer name -> the state tensors shaped like each parameter it steps
TENSOR_STATE: dict[str, tuple[str, ...]] = {
    "adamw": ("exp_avg", "exp_avg_sq"),  # torch.optim.AdamW's moments
    "muon": ("momentum_buffer",),  # torch.optim.Muon's one buffer (its matrices: muon.py)
}
COUNTS_STEPS = {"adamw": True, "muon": False}  # keeps "step" (a scalar) per parameter
# optimizer name -> (the optimizer that steps the hidden matrices, the one that steps the rest:
# embeddings, LM head, router, norms, biases), as optim/groups.py splits them; the planner's state bytes
PARTS: dict[str, tuple[str, str]] = {"adamw": ("adamw", "adamw"), "muon": ("muon", "adamw")}
# the optimizers that orthogonalise each whole matrix (Newton-Schulz: optim/muon.py), which the planner
# counts as FLOPs and, where the engine splits a matrix, as assembly traffic (optim/sharded.py)
ORTHOGONALISES: frozenset[str] = frozenset({"muon"})
DEFAULT = "adamw"  # a group without "optimizer" (torch's AdamW, and every checkpoint before optim.name)

# every state name any optimizer writes: what tells a checkpoint's optimizer tensors from its weights
ALL_TENSOR_STATE: tuple[str, ...] = tuple(dict.fromkeys(k for keys in TENSOR_STATE.values() for k in keys))


def group_optimizer(group: Mapping) -> str:
    """Which optimizer steps a parameter group (a composite's groups say it; torch's AdamW's do not)."""
    return group.get("optimizer", DEFAULT)


def state_keys(group: Mapping) -> tuple[str, ...]:
    """The state tensors kept for every parameter of `group`."""
    return TENSOR_STATE[group_optimizer(group)]


def state_tensors_per_param(name: str) -> int:
    """How many parameter-shaped fp32 tensors optimizer `name` keeps (the planner's state bytes)."""
    return len(TENSOR_STATE[name])
