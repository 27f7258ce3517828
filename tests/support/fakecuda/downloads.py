"""Device-to-host copies into page-locked memory with non_blocking=True: on CUDA the host does not wait
for them, and the destination holds its old bytes until the stream reaches the copy. Code that reads
the destination before waiting for it reads whatever was there. The waits that cover a copy: its
stream's synchronize, an event recorded on that stream after it (synchronize, or a query that says
done), a device synchronize, and a stream that was made to wait for it (wait_stream, wait_event) then
synchronized; any read that makes the host wait (item, a blocking copy) lands every copy here, more
than CUDA does (it waits for its own stream), so the tier may miss a missing wait but never invents one.

Here such a copy takes the source's values at once (what the stream will copy: the work queued before
it is done by then, the work queued after it comes later) and lands them only at one of those waits.
Until then the destination is filled with 0xFF bytes (NaN in every float dtype), so a checkpoint
written from it without the wait is visibly wrong rather than a copy of the previous save's values.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_lock = threading.Lock()


@dataclass
class _Copy:
    seq: int
    destination: torch.Tensor
    values: torch.Tensor
    streams: list[Any] = field(default_factory=list)  # the streams whose synchronize covers it


_queued: list[_Copy] = []
_issued = 0
landed_by: Counter = Counter()  # thread name -> copies whose wait it was (which thread waited for the device)


def queue(destination: torch.Tensor, values: torch.Tensor) -> None:
    """A non-blocking copy of `values` (a device tensor's, cloned) into the page-locked `destination`,
    on the current stream."""
    global _issued
    values, stream = values.clone(), torch.cuda.current_stream()
    with _lock:  # the fill too: a land() on another thread between the two would be overwritten
        _issued += 1
        _queued.append(_Copy(_issued, destination, values, [stream]))
        if destination.is_contiguous():
            destination.view(torch.uint8).fill_(0xFF)
        else:
            destination.fill_(float("nan"))


def issued() -> int:
    """The sequence number of the last copy queued: an event recorded now covers every copy up to it."""
    with _lock:
        return _issued


def _covered(copy: _Copy, stream: Any, upto: Optional[int]) -> bool:
    return (stream is None or any(s is stream for s in copy.streams)) and (upto is None or copy.seq <= upto)


def wait(waiting: Any, stream: Any, upto: Optional[int] = None) -> None:
    """Stream `waiting` waits (on the device) for `stream`'s work up to copy `upto`: its synchronize
    covers those copies."""
    with _lock:
        for copy in _queued:
            if _covered(copy, stream, upto) and not any(s is waiting for s in copy.streams):
                copy.streams.append(waiting)


def land(stream: Any = None, upto: Optional[int] = None) -> None:
    """The host has waited for `stream` (None: every stream) up to copy `upto` (None: everything queued)."""
    with _lock:
        landing = [copy for copy in _queued if _covered(copy, stream, upto)]
        _queued[:] = [copy for copy in _queued if not _covered(copy, stream, upto)]
        if landing:
            landed_by[threading.current_thread().name] += len(landing)
        for copy in landing:
            copy.destination.copy_(copy.values)
