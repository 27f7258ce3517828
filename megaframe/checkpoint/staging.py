"""Host copies of a rank's checkpoint shard for a background save (train.async_save).

The writer thread reads the shard while training goes on, so its values are copied to host memory
when the save starts. Each piece used to be copied with `tensor.to("cpu")` into fresh memory: from
a GPU into pageable memory that is a copy the host waits for, one per parameter and optimizer
tensor (hundreds of waits a save, each after everything queued before it), and every save
page-faulted a new shard's worth of host memory.

Here the copies go into host buffers made at the first save and reused by every later one (store.save
waits for the previous save before starting the next, so no writer still reads them). A device
tensor is copied into page-locked memory, queued without waiting (non_blocking); an event recorded
after the last copy is what the writer thread waits for before it reads any. A host tensor (an
optimizer state offloaded to the CPU) is copied at once into pageable memory: page-locking it would
take host RAM from the offloaded states for nothing.

On CUDA the copies run on the step loop's stream: the step's later kernels cannot change what is
copied, a device tensor freed after its copy is queued is reused only by work queued after it (the
caching allocator is stream-ordered), and the next step's kernels start after the copies (about the
shard's bytes over the host link: tools/bench_save.py reports it as the next step's extra time).

Cost: host memory the size of the rank's shard in its own dtypes (weights in theirs, masters and
optimizer states in fp32), page-locked for what lives on the device, plus the unused ends of slabs,
held from the first background save to the end of the run (torch.distributed.checkpoint's async save
with pinned memory holds the same).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

SLAB_BYTES = 1 << 28  # 256 MiB: a power of two, which torch's page-locked allocator rounds every request up to
_ALIGN = 64  # each piece starts on a 64-byte boundary, so any dtype can view it


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class HostStaging:
    """The host buffers of one rank's background saves, kept from save to save: page-locked slabs for
    copies from the device (when pin_device_copies: a rank on a GPU), pageable ones for copies of host
    tensors. Slabs of SLAB_BYTES are filled in order; a piece larger than a slab gets a slab of its own
    (the next power of two). A save of the same shard as the last one fills the same slabs in the same
    places and allocates nothing."""

    def __init__(self, pin_device_copies: bool):
        self.pin_device_copies = pin_device_copies
        self.pinned_slabs: list[torch.Tensor] = []  # uint8, page-locked: copies from the device
        self.host_slabs: list[torch.Tensor] = []  # uint8, pageable: copies of host tensors
        self.staged_bytes = 0  # what the latest save's copies filled (the planner's figure: plan/host.py)

    def start(self) -> "Snapshot":
        """The copies of one save; the previous save's writer must have finished reading them."""
        self.staged_bytes = 0
        return Snapshot(self)

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(slab.numel() for slab in (*self.pinned_slabs, *self.host_slabs))


class _Cursor:
    """Where a save stands in one list of slabs."""

    def __init__(self, slabs: list[torch.Tensor], pinned: bool):
        self.slabs, self.pinned = slabs, pinned
        self.slab, self.offset = 0, 0

    def region(self, nbytes: int) -> torch.Tensor:
        """The next nbytes (64-byte aligned), allocating a slab when none left holds them."""
        start = -(-self.offset // _ALIGN) * _ALIGN
        while self.slab < len(self.slabs) and start + nbytes > self.slabs[self.slab].numel():
            self.slab, start = self.slab + 1, 0
        if self.slab == len(self.slabs):
            size = max(SLAB_BYTES, _next_power_of_two(nbytes))
            self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned))
        self.offset = start + nbytes
        return self.slabs[self.slab][start:start + nbytes]


class Snapshot:
    """One save's host copies (HostStaging.start)."""

    def __init__(self, staging: HostStaging):
        self._staging = staging
        self._host_copies = _Cursor(staging.host_slabs, pinned=False)
        # without pinning, device copies share the pageable slabs and their cursor
        self._device_copies = (_Cursor(staging.pinned_slabs, pinned=True) if staging.pin_device_copies
                               else self._host_copies)
        self._queued_on: Optional[torch.device] = None  # the device whose stream holds copies not yet done

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor that will hold `tensor`'s values as they are now (queued, not yet done, for a
        device tensor on a GPU: read it only after ready()'s wait)."""
        source = tensor.detach()
        on_device = source.device.type != "cpu"
        cursor = self._device_copies if on_device else self._host_copies
        nbytes = source.numel() * source.element_size()
        host = cursor.region(nbytes).view(source.dtype).view(source.shape)
        self._staging.staged_bytes += nbytes
        queued = on_device and cursor.pinned
        if queued:
            if self._queued_on is not None and self._queued_on != source.device:
                raise ValueError(f"a snapshot copies from one device: {self._queued_on}, then {source.device}")
            self._queued_on = source.device
        host.copy_(source, non_blocking=queued)
        return host

    def ready(self) -> Callable[[], None]:
        """Called once every piece is copied, on the thread that queued the copies: the function the
        writer calls before reading any copy (it waits for the queued copies; the step loop does not)."""
        if self._queued_on is None or self._queued_on.type != "cuda":
            return lambda: None
        done = torch.cuda.Event(blocking=True)  # the writer sleeps until the copies are done, not spins a core
        done.record(torch.cuda.current_stream(self._queued_on))
        return done.synchronize
