"""Naming the rank that hung, once a collective has timed out on the others.

A rank stuck outside any collective (a dead filesystem read, a wedged kernel) leaves its peers
waiting inside one; after train.collective_timeout_s they raise. Each of them then marks itself in
the process group's store and waits a little for the others to do the same: the ranks that never
mark themselves are the hung ones. The store is served by torchrun's agent (or rank 0's process)
on its own thread, so it still answers when a rank's main thread is stuck.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

_KEY = "megaframe/timed_out/"


def is_collective_timeout(err: BaseException) -> bool:
    """Whether err is a collective (or the store behind it) giving up after the group's timeout."""
    text = str(err).lower()  # gloo: "Timed out waiting ...ms"; NCCL's watchdog: "... Timeout(ms)=..."
    return isinstance(err, RuntimeError) and ("timed out" in text or "timeout" in text)


def hung_ranks(wait_s: float, poll_s: float = 0.2) -> list[int]:
    """Mark this rank as alive-but-waiting, wait up to wait_s for the others; return the ranks that
    never marked themselves (empty when everyone did, or without a process group)."""
    if not dist.is_initialized():
        return []
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=max(wait_s, 1.0)))
    world = dist.get_world_size()
    store.set(f"{_KEY}{dist.get_rank()}", "1")
    keys = [f"{_KEY}{r}" for r in range(world)]
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(poll_s)


def describe_hang(step: int, timeout_s: float, wait_s: float) -> str:
    """The one-line message of a collective timeout at `step`, naming the hung ranks when found."""
    try:
        missing = hung_ranks(wait_s)
    except (RuntimeError, OSError):  # the store itself is gone with the rank that served it
        missing = []
    where = f"at step {step}" if step else "before the first step"
    fix = ("check that rank's host (its log, dmesg, the GPU) or raise train.collective_timeout_s "
           "if the work between collectives is legitimately that slow")
    if missing:
        who = ", ".join(str(r) for r in missing)
        return (f"rank{'s' if len(missing) > 1 else ''} {who} did not reach a collective within "
                f"train.collective_timeout_s={timeout_s:g} {where}; {fix}")
    return f"a collective timed out after train.collective_timeout_s={timeout_s:g} {where}; {fix}"
