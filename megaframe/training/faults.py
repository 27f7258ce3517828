"""Faults injected on purpose, for the tests of the failure paths (never set in a real run).

MEGAFRAME_FAULTS is a comma-separated list of KIND@STEP or KIND@STEP:RANK (RANK omitted: every rank):
  nan_grad@5:0   rank 0's gradients of step 5 become NaN (all of them, on that rank only)
  hang@3:1       rank 1 sleeps forever at the start of step 3
  kill@4:1       SIGKILL to rank 1 at the start of step 4 (once per MEGAFRAME_FAULTS_STAMPS directory when
                 set: a restarted job that replays step 4 then goes on)
  spike@8        every target of step 8 becomes token 0 on every rank (a byte text never holds): a loss spike
  kill_in_save@4 SIGKILL to the process while the checkpoint of step 4 is being written (its files
                 written, not yet published), on the writer's thread under train.async_save
  disk_full@4    the checkpoint of step 4 fails as a full disk makes it fail (OSError ENOSPC) before its files
                 are written
  slow_save@4    the checkpoint of step 4 waits 3 s before its files are written (under
                 train.async_save training goes on meanwhile: what is written must be step 4's); with
                 MEGAFRAME_FAULTS_STAMPS set, `save-rankR` is written there as the wait starts
Steps count from 1 (the step being taken).
MEGAFRAME_FAULTS_STAMPS, when set, names a directory where a rank writes `hang-rankR` as it starts
hanging, so a test can time the watchdog from the hang rather than from a start-up it does not control.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

import torch

ENV = "MEGAFRAME_FAULTS"
STAMPS_ENV = "MEGAFRAME_FAULTS_STAMPS"
KINDS = ("nan_grad", "hang", "spike", "kill_in_save", "slow_save", "kill", "disk_full")


@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    kind: str
    step: int
    rank: Optional[int]


def parse(spec: str) -> list[Fault]:
    """MEGAFRAME_FAULTS's value as Faults; ValueError names a malformed entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        try:
            kind, where = entry.split("@")
            step, _, rank = where.partition(":")
            fault = Fault(kind, int(step), int(rank) if rank else None)
        except ValueError:
            raise ValueError(f"{ENV}: {entry!r} is not KIND@STEP[:RANK]") from None
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r}; one of {list(KINDS)}")
        faults.append(fault)
    return faults


class Faults:
    """The faults planned for this rank."""

    def __init__(self, rank: int, spec: Optional[str] = None):
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.planned = [f for f in parse(spec) if f.rank in (None, rank)]
        self.rank = rank

    def _due(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.planned)

    def in_save_hook(self, step: int):
        """The checkpoint save's hook for `step` (called with "write", then "publish"): None unless
        a fault is due in that save."""
        kill, slow, full = self._due("kill_in_save", step), self._due("slow_save", step), self._due("disk_full", step)
        if not (kill or slow or full):
            return None

        def hook(stage: str) -> None:
            if full and stage == "write":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"global_step{step}")
            if slow and stage == "write":
                if stamps := os.environ.get(STAMPS_ENV):  # a test's signal can then aim at the save
                    with open(os.path.join(stamps, f"save-rank{self.rank}"), "w") as stamp:
                        stamp.write(str(step))
                time.sleep(3)
            if kill and stage == "publish":
                os.kill(os.getpid(), signal.SIGKILL)
        return hook

    def batches(self, step: int, batches: list) -> list:
        """The micro-batches of `step`, their targets all token 0 when a spike is due."""
        if not self._due("spike", step):
            return batches
        return [(inputs, torch.zeros_like(targets)) for inputs, targets in batches]

    def before_step(self, step: int, backend) -> Optional[torch.utils.hooks.RemovableHandle]:
        """Apply the faults due at the start of `step` (backend: the run's Backend); returns a hook to
        remove after the step."""
        if self._due("hang", step):
            stamps = os.environ.get(STAMPS_ENV)
            if stamps:
                with open(os.path.join(stamps, f"hang-rank{self.rank}"), "w") as stamp:
                    stamp.write(str(step))
            while True:  # a rank stuck outside any collective (a dead NFS read, a wedged kernel)
                time.sleep(3600)
        if self._due("kill", step):
            stamps = os.environ.get(STAMPS_ENV)
            stamp = os.path.join(stamps, f"kill-rank{self.rank}-step{step}") if stamps else None
            if stamp is None or not os.path.exists(stamp):
                if stamp:
                    open(stamp, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        if self._due("nan_grad", step):
            # through the output of this rank's model (the loss, or a pipeline stage's activations)
            # as its backward starts: every gradient the rank computes becomes NaN, whether the engine
            # steps the parameters the forward used or (FSDP2) a gathered copy of them
            def poison(_module, _inputs, output):
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
            return backend.hook_forward(poison)
        return None
