"""Activation checkpointing, and how a module knows it is being recomputed.

Under checkpointing a block's forward runs twice: once in the forward pass (its saved tensors
dropped) and again inside backward, to rebuild them. What the second pass computes is needed only
for the gradient. A module that records something of its forward on itself (the MoE layer's
aux loss with its graph, its router statistics, its expert counts for bias balancing) must not
record it again then: the record would double-count, and a tensor kept with its graph would hold
the whole recomputed block alive until the next step."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

# per thread (the autograd engine may run backward on its own threads; the recompute runs, and
# reads this, on the one that entered it)
_recomputing = contextvars.ContextVar("megaframe_recomputing", default=False)


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside backward."""
    return _recomputing.get()


class _SecondPass:
    """Marks a recomputation. One object may be entered more than once: a pipeline schedule that
    splits backward (zero-bubble) recomputes a block for its input gradients and again for its
    weight gradients, both through the context the checkpoint made at forward time."""

    def __init__(self) -> None:
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> None:
        self._tokens.append(_recomputing.set(True))

    def __exit__(self, *exc) -> None:
        _recomputing.reset(self._tokens.pop())



def checkpointed(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """fn(*args) with its activations recomputed in backward (torch's non-reentrant checkpoint),
    the recomputation marked for recomputing()."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), _SecondPass()))
