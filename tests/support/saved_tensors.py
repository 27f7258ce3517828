"""What autograd saves for backward, measured: the planner's activation terms are checked against it."""
from __future__ import annotations

import torch


def saved_bytes(model: torch.nn.Module, idx: torch.Tensor) -> int:
    """Bytes of the distinct storages one forward of model(idx, idx) saves for backward, parameters
    excluded (saved-tensor hooks)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(saved.values())
