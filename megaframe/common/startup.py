"""The garbage collector paused while megaframe-train starts.

Start-up imports torch, torch._dynamo (torch's optimizers import it) and Hydra: about 300,000
tracked objects (len(gc.get_objects()) after those imports: 301,125) that live as long as the
process, and almost no garbage. The collector's passes over them
while they are created were about 0.5 s of every start (`import torch._dynamo`: 1.28 s collecting,
0.94 s paused, on the CI host). So the entry point pauses it, and the process resumes it where
start-up ends: once the trainer's engine is built, or before this process goes on to wait for ranks
or jobs it launched. Resuming freezes what start-up made (gc.freeze, Python's pattern for long-lived
start-up state): later collections, in the step loop too, no longer walk those objects; a cycle
start-up left behind stays in memory, as it would have until the first full collection anyway.
"""
from __future__ import annotations

import gc

_paused = {"by_us": False}


def pause_collector() -> None:
    """At the entry point, before the first heavy import."""
    if gc.isenabled():
        gc.disable()
        _paused["by_us"] = True


def resume_collector() -> None:
    """Where start-up ends (idempotent; a no-op where pause_collector did not pause it, such as a
    test or a user's script that builds a Trainer)."""
    if _paused["by_us"]:
        _paused["by_us"] = False
        gc.freeze()
        gc.enable()
