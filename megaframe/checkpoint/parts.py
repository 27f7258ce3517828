"""What a checkpoint holds besides the engine's tensors: named stateful parts.

A part is anything with state_dict() and load_state_dict(state, resume). The checkpoint manager
(checkpoint/manager.py) writes each part's state under the part's registered name, and hands it
back on resume, in registration order, after the engine has loaded the weights and the optimizer.
A piece of run state (fp8 scales, a data-mixture schedule, a counter) is one more registered part:
neither the trainer nor the format changes.

Two kinds, told apart by what they hold:
- A whole part (Stateful) is the same on every rank, or is pooled to be: its state goes into the
  client state (state.json of the layout-free checkpoint, the engine's own files) and comes back in
  any layout. A part whose state_dict() returns None writes nothing that time.
- A rank part (RankStateful) is one rank's own streams (a TP rank's dropout generator): its state
  goes into that rank's rng_rank{R}.pt and comes back only in the layout it was saved in. Resumed
  into another layout from a layout-free checkpoint, it restarts from (seed, step) with reseed().

torchtitan's checkpointer takes `states={...}` the same way; OLMo-core's callbacks are Stateful.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable


@dataclass
class Resume:
    """What a part learns about the checkpoint it is restored from."""

    path: Path  # the checkpoint directory (for the parts' one-line refusals and warnings)
    step: int  # the step the checkpoint was taken after
    client_state: dict[str, Any]  # the whole client state: older checkpoints keep a part's record under other keys
    layout_free: bool  # read from the layout-free files (any layout), else the engine's own (same layout)
    announce: bool  # this rank prints (rank 0)
    notes: list[str] = field(default_factory=list)  # lines printed (rank 0) after "resumed from ..."

    def note(self, line: Optional[str]) -> None:
        """A line for the console, printed after the resume's own line (None: nothing to say)."""
        if line:
            self.notes.append(line)


@runtime_checkable
class Stateful(Protocol):
    """A whole part: the same state on every rank, restored in any layout."""

    def state_dict(self) -> Any:
        """The part's state (JSON-representable: state.json holds it), or None to write nothing."""

    def load_state_dict(self, state: Any, resume: Resume) -> None:
        """Take the saved state back (None: the checkpoint holds none, e.g. written before the part
        existed); refuse with a CheckpointError naming the key and the fix."""


@runtime_checkable
class RankStateful(Stateful, Protocol):
    """A rank part: this rank's own streams, restored only in the layout they were saved in."""

    def reseed(self, seed: int) -> None:
        """Resumed into another layout: restart this rank's streams from `seed` (train.seed + step)."""


class Plain:
    """A torch-style object (state_dict(), load_state_dict(state)) as a whole part, e.g. StepGuard."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_state_dict(self, state: Any, resume: Resume) -> None:
        if state is not None:
            self.obj.load_state_dict(state)
