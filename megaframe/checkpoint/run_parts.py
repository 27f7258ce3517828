"""The run's own parts of a checkpoint (checkpoint/parts.py), each with the checks its resume makes:
the train state (the global batch), the data order and the blend's cursor, the layout, engine and
schedule record, and the tokenizer record. The trainer registers them; their keys are the client
state's names since checkpoints had them, so every older checkpoint resumes."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

from megaframe.checkpoint import resume_checks, tokenizer_check
from megaframe.checkpoint.parts import Resume
from megaframe.checkpoint.universal import CheckpointError


class TrainState:
    """step, consumed_samples and global_batch_size, at the client state's top level (registered
    inline: tools and every older checkpoint read them there). A resume with another global batch
    moves the data position (the samples of step k are a function of (seed, k, global batch)): it
    is refused unless train.on_batch_size_change=move_position."""

    def __init__(self, step: Callable[[], int], global_batch_size: int, on_batch_size_change: str,
                 reached: Callable[[int], None] = lambda step: None):
        """step(): the trainer's step; reached(step): told the checkpoint's step before any check,
        so a refused resume ends "failed at step N" with that step's tokens, not at step 0."""
        self.step, self.global_batch_size, self.on_change = step, global_batch_size, on_batch_size_change
        self.reached = reached

    def state_dict(self) -> dict[str, Any]:
        step = self.step()
        return {"step": step, "consumed_samples": step * self.global_batch_size,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any], resume: Resume) -> None:
        self.reached(resume.step)
        saved = state.get("global_batch_size")
        if saved is None or saved == self.global_batch_size:
            return
        consumed = state.get("consumed_samples", resume.step * saved)
        moved = resume.step * self.global_batch_size
        if self.on_change != "move_position":
            raise CheckpointError(
                f"train.resume: checkpoint {resume.path} was trained with parallel.global_batch_size={saved} "
                f"({consumed} samples consumed); this run's {self.global_batch_size} would move the data "
                f"position to sample {moved}: set parallel.global_batch_size={saved}, or accept the move with "
                f"train.on_batch_size_change=move_position")
        if resume.announce:
            print(f"megaframe: warning: parallel.global_batch_size {saved} -> {self.global_batch_size} "
                  f"(train.on_batch_size_change=move_position): the data position moves from sample {consumed} "
                  f"to {moved}", file=sys.stderr, flush=True)


class DataOrder:
    """The "data" record (resume_checks.data_record): a resume that changes the data order is
    refused unless train.resume_accept_data_change; `changed` says whether it did."""

    def __init__(self, seq_length: int, seed: int, data, accept: bool):
        self.record = resume_checks.data_record(seq_length, seed, data)  # the sources' checksums: read once
        self.accept = accept
        self.changed = False

    def state_dict(self) -> dict[str, Any]:
        return self.record

    def load_state_dict(self, state: Any, resume: Resume) -> None:
        # the whole client state: checkpoints written before the record existed say it elsewhere
        self.changed = resume_checks.check_data_order(resume.path, resume.client_state, self.record, self.accept,
                                                      resume.announce)


class BlendCursor:
    """A blend's position ("blend_cursor"): restoring it saves re-walking the blend from sample 0;
    where it is absent, or the data order changed, the walk gives the same samples."""

    def __init__(self, data, order: DataOrder, step: Callable[[], int], global_batch_size: int):
        self.data, self.order, self.step, self.global_batch_size = data, order, step, global_batch_size

    def state_dict(self) -> Optional[dict]:
        if not self.data.blended:
            return None
        return self.data.train.cursor_at(self.step() * self.global_batch_size, self.global_batch_size).state_dict()

    def load_state_dict(self, state: Any, resume: Resume) -> None:
        if self.data.blended and state is not None and not self.order.changed:
            self.data.train.restore(state)


class RunRecord:
    """The layout, engine and schedule ("run"): a resume names, old -> new, what it changes."""

    def __init__(self, cfg, layout):
        self.record = resume_checks.run_record(cfg, layout)

    def state_dict(self) -> dict[str, Any]:
        return self.record

    def load_state_dict(self, state: Any, resume: Resume) -> None:
        resume.note(resume_checks.change_line(resume.path, resume.client_state, self.record))


class TokenizerRecord:
    """The run's tokenizer record (checkpoint/tokenizer_check.py): a resume with another tokenizer
    is refused, before any tensor is read where state.json holds the record."""

    def __init__(self, record: dict, accept: bool):
        self.record, self.accept = record, accept

    def state_dict(self) -> dict:
        return self.record

    def precheck(self, path: Path, announce: bool) -> None:
        """Before the engine loads: from the layout-free state.json (nothing without one)."""
        tokenizer_check.check_resume(path, self.record, announce, accept=self.accept)

    def load_state_dict(self, state: Any, resume: Resume) -> None:
        if not resume.layout_free:  # the engine's own files: their client state is read only now
            tokenizer_check.check_resume(resume.path, self.record, resume.announce, resume.client_state,
                                         accept=self.accept)
