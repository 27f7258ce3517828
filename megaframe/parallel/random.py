"""Dropout RNG under tensor (and context) parallelism.

Outside TP regions every TP rank holds the same activations, so dropout uses torch's default
generator, seeded identically on every TP rank. Inside TP regions (per-rank heads, and sequence
shards under SP) each TP rank needs its own stream: TPDropoutRNG.fork() swaps it in. Attention
dropout under context parallelism draws from the same stream, which then also differs by cp rank
(each holds other heads under Ulysses, other query rows under ring attention).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

_TP_SEED_OFFSET = 2718  # Megatron's offset, so the TP streams never equal the default stream
_CP_SEED_STRIDE = 7919  # cp rank i's streams start i strides on: apart from every TP rank's


def get_rng_states() -> list[torch.Tensor]:
    """The default generators' states: CPU, plus the current CUDA device's where there is one."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    return states


def set_rng_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if torch.cuda.is_available() and len(states) > 1:
        torch.cuda.set_rng_state(states[1])


class TPDropoutRNG:
    """A per-TP-rank (and per-CP-rank) generator state, swapped in around dropout inside TP regions
    and around attention dropout under context parallelism."""

    def __init__(self, seed: int, tp_rank: int, cp_rank: int = 0):
        saved = get_rng_states()
        torch.manual_seed(seed + _TP_SEED_OFFSET + tp_rank + _CP_SEED_STRIDE * cp_rank)
        self.states = get_rng_states()
        set_rng_states(saved)

    @contextmanager
    def fork(self):
        """Run the block with this rank's TP stream, then restore the default stream."""
        saved = get_rng_states()
        set_rng_states(self.states)
        try:
            yield
        finally:
            self.states = get_rng_states()
            set_rng_states(saved)

    def state_dict(self) -> dict:
        return {"states": [s.clone() for s in self.states]}

    def load_state_dict(self, state: dict) -> None:
        self.states = [s.clone() for s in state["states"]]
