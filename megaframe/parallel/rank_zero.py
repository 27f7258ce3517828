"""One answer for every rank from rank 0: what shared storage says (a run dir's lock, its checkpoints,
a stop file) is read once and broadcast.

Ranks that read shared storage themselves can see different things (NFS and Lustre clients cache
directories), and a rank that fails alone leaves the others waiting in their next collective until
the timeout. So rank 0 decides, and every rank returns its value or raises its exception."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def decided_by_rank_zero(decide: Callable[[], T]) -> T:
    """decide() run on rank 0 alone; every rank returns what it returned, or raises the exception it
    raised (an Exception, sent pickled: raise ones whose message is their only argument). Without a
    process group, or at one rank, it is decide(). A collective: every rank calls it."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    holder: list = [None]
    if dist.get_rank() == 0:
        try:
            holder[0] = ("value", decide())
        except Exception as err:  # noqa: BLE001 - every rank raises it: none is left waiting
            holder[0] = ("raised", err)
    dist.broadcast_object_list(holder, src=0)
    kind, payload = holder[0]
    if kind == "raised":
        raise payload
    return payload
