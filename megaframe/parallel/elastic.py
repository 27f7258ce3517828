"""Joining the process group again after a torchrun restart (--max-restarts)."""
from __future__ import annotations

import os

import torch.distributed as dist


def join_restarted_group(backend: str) -> bool:
    """Under torchrun with its agent store, init the default group on a per-attempt store prefix.

    torchrun keeps one TCPStore (MASTER_PORT) for every restart attempt and env:// init does not
    namespace its keys, so after a rank is killed the new attempt's gloo ranks read the dead
    attempt's addresses and hang in connectFullMesh (or fail with "Connection refused"). Measured
    with torch 2.13: a plain init_process_group("gloo") script hangs on attempt 1; with the prefix
    it restarts cleanly. Returns False (doing nothing) outside torchrun or when already joined."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"megaframe/attempt{attempt}/", store),
                            rank=rank, world_size=world)
    return True
