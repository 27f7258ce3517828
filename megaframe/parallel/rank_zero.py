"""One answer for every rank from rank 0: what shared storage says (a run dir's lock, its checkpoints,
a stop file) is read once and broadcast.

Ranks that read shared storage themselves can see different things (NFS and Lustre clients cache
directories), and a rank that fails alone leaves the others waiting in their next collective until
the timeout. So rank 0 decides, and every rank returns its value or raises its exception."""
from __future__ import annotations

import pickle
from typing import Callable, TypeVar

T = TypeVar("T")


def decided_by_rank_zero(decide: Callable[[], T]) -> T:
    """decide() run on rank 0 alone; every rank returns what it returned, or raises the exception it
    raised: the exception itself where it survives pickling, else a RunFailure with its message and
    exit code (an exception whose __init__ takes more than the message cannot be rebuilt; one that
    cannot be pickled would end rank 0 inside the broadcast and leave the others waiting). Rank 0
    raises its own. Without a process group, or at one rank, it is decide(). A collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    holder: list = [None]
    raised = None
    if dist.get_rank() == 0:
        try:
            holder[0] = ("value", decide())
        except BaseException as err:  # noqa: BLE001 - every rank raises it: none is left waiting
            raised = err
            holder[0] = ("raised", _sendable(err))
    dist.broadcast_object_list(holder, src=0)
    if raised is not None:
        raise raised
    kind, payload = holder[0]
    if kind == "raised":
        raise payload
    return payload


def _sendable(err: BaseException) -> BaseException:
    """err where pickle rebuilds it, else a RunFailure saying the same with the same exit code."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any failure to rebuild it
        from megaframe.common.failures import ExitCode, RunFailure

        stand_in = RunFailure(str(err) or type(err).__name__)
        stand_in.exit_code = getattr(err, "exit_code", ExitCode.INTERNAL)
        return stand_in
