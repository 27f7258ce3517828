"""Host copies of a rank's checkpoint shard for a background save (train.async_save).

The writer thread reads the shard while training goes on, so its values are copied to host memory
when the save starts. Each piece used to be copied with `tensor.to("cpu")` into fresh memory: from
a GPU into pageable memory that is a copy the host waits for, one per parameter and optimizer
tensor (hundreds of waits a save, each after everything queued before it), and every save
page-faulted a new shard's worth of host memory.

Here the copies go into host buffers made at the first save and reused by every later one (store.save
waits for the previous save before starting the next, so no writer still reads them). On a GPU the
buffers are page-locked and each copy is queued without waiting (non_blocking from the device into
page-locked memory); an event recorded after the last copy is what the writer thread waits for before
it reads any. The step loop's later kernels run after the copies on the same stream, so they cannot
change what is copied, and a device tensor freed after its copy is queued is reused only by work
queued after it (the caching allocator is stream-ordered).

Cost: page-locked host memory the size of the rank's shard in its own dtypes, plus the unused ends
of slabs, held from the first background save to the end of the run (torch.distributed.checkpoint's
async save with pinned memory holds the same).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

SLAB_BYTES = 1 << 28  # 256 MiB: a power of two, which torch's page-locked allocator rounds every request up to
_ALIGN = 64  # each piece starts on a 64-byte boundary, so any dtype can view it


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class HostStaging:
    """The host buffers of one rank's background saves, kept from save to save (pinned: page-locked,
    for a rank whose tensors live on a GPU). Slabs of SLAB_BYTES are filled in order; a piece larger
    than a slab gets a slab of its own (the next power of two). A save of the same shard as the last
    one fills the same slabs in the same places and allocates nothing."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.slabs: list[torch.Tensor] = []  # uint8 host tensors

    def start(self) -> "Snapshot":
        """The copies of one save; the previous save's writer must have finished reading them."""
        return Snapshot(self)

    def _new_slab(self, nbytes: int) -> torch.Tensor:
        slab = torch.empty(max(SLAB_BYTES, _next_power_of_two(nbytes)), dtype=torch.uint8)
        return slab.pin_memory() if self.pinned else slab

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(slab.numel() for slab in self.slabs)


class Snapshot:
    """One save's host copies (HostStaging.start)."""

    def __init__(self, staging: HostStaging):
        self._staging = staging
        self._slab, self._offset = 0, 0
        self._queued_on: Optional[torch.device] = None  # the device whose stream holds copies not yet done

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor that will hold `tensor`'s values as they are now (queued, not yet done, for a
        device tensor on a GPU: read it only after ready()'s wait)."""
        source = tensor.detach()
        nbytes = source.numel() * source.element_size()
        host = self._region(nbytes).view(source.dtype).view(source.shape)
        on_device = source.device.type != "cpu"
        queued = on_device and self._staging.pinned
        host.copy_(source, non_blocking=queued)
        if queued:
            self._queued_on = source.device
        return host

    def ready(self) -> Callable[[], None]:
        """Called once every piece is copied, on the thread that queued the copies: the function the
        writer calls before reading any copy (it waits for the queued copies; the step loop does not)."""
        if self._queued_on is None or self._queued_on.type != "cuda":
            return lambda: None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._queued_on))
        return done.synchronize

    def _region(self, nbytes: int) -> torch.Tensor:
        """The next nbytes of the slabs (64-byte aligned), allocating a slab when none left holds them."""
        slabs = self._staging.slabs
        start = -(-self._offset // _ALIGN) * _ALIGN
        while self._slab < len(slabs) and start + nbytes > slabs[self._slab].numel():
            self._slab, start = self._slab + 1, 0
        if self._slab == len(slabs):
            slabs.append(self._staging._new_slab(nbytes))
        self._offset = start + nbytes
        return slabs[self._slab][start:start + nbytes]
