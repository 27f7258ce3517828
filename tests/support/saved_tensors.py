"""What autograd saves for backward, measured: the planner's activation terms are checked against it."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def saved_bytes(model: torch.nn.Module, idx: Optional[torch.Tensor] = None,
                forward: Optional[Callable[[], Any]] = None) -> int:
    """Bytes of the distinct storages a forward saves for backward, the model's parameters excluded
    (saved-tensor hooks): model(idx, idx), or `forward()` where given (one block of the model, say)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward() if forward is not None else model(idx, idx)
    return sum(saved.values())
