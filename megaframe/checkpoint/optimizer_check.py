"""The optimizer a checkpoint was trained with ("optimizer_record" in its client state: {"name": ...}).
A resume under another optim.name would read tensors the new optimizer does not keep (Adam's two
moments are not Muon's momentum) or none at all: refused in one line before any tensor is read,
unless train.resume_accept_optimizer_change=true, which says in one line that the new optimizer's
state starts fresh from the checkpoint's weights (the engines then load weights only:
optim/state.py's same_optimizer). A checkpoint without the record was written by AdamW, megaframe's
only optimizer before optim.name existed."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megaframe.checkpoint import universal
from megaframe.checkpoint.parts import Resume
from megaframe.checkpoint.universal import CheckpointError
from megaframe.optim.state import RECORD_KEY, saved_optimizer


class OptimizerRecord:
    """The run's optimizer as a whole checkpoint part, checked against the checkpoint's on resume."""

    def __init__(self, name: str, accept: bool):
        self.name, self.accept = name, accept

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def precheck(self, path: Path, announce: bool) -> None:
        """Before the engine loads: from the layout-free state.json (an engine's own files: at load)."""
        if universal.has_universal(path):
            self.check(path, universal.read_state(path), announce)

    def load_state_dict(self, state: Any, resume: Resume) -> None:
        if not resume.layout_free:
            self.check(resume.path, resume.client_state, resume.announce)

    def check(self, path: Path, client_state: dict, announce: bool) -> None:
        """Refuse a checkpoint of another optimizer, or with `accept` say that its state starts fresh."""
        saved = saved_optimizer(client_state)
        if saved == self.name:
            return
        if not self.accept:
            raise CheckpointError(
                f"train.resume: checkpoint {path} was trained with optim={saved}, this run asks for optim={self.name}, "
                f"whose state it does not hold: resume with optim={saved}, or start {self.name}'s state fresh from its "
                f"weights with train.resume_accept_optimizer_change=true")
        if announce:
            print(f"megaframe: warning: train.resume_accept_optimizer_change=true: checkpoint {path} was trained with "
                  f"optim={saved}; optim={self.name} starts its state fresh from the checkpoint's weights",
                  file=sys.stderr, flush=True)
