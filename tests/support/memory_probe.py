"""Per-process peak memory and collective traffic, for the scale tests of checkpoint save and load.

peak_rss: the kernel's high-water mark of this process's resident memory (VmHWM), reset through
/proc/self/clear_refs before the measured section: it sees every allocation (torch's, safetensors'
memory maps, pickles), not only Python's. CollectiveBytes patches the ProcessGroup class, under
every collective torch.distributed and DeepSpeed issue, and records the tensor bytes of each call."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_COLLECTIVES = ("allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
                "all_gather_single", "allreduce", "allreduce_coalesced", "alltoall", "alltoall_base",
                "all_to_all_single", "broadcast",
                "gather", "scatter", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                "reduce_scatter_tensor_coalesced", "send", "recv", "recv_anysource")


def fixed_mmap_threshold() -> None:
    """Make glibc hand every allocation above 128 KiB straight back to the kernel when freed.

    By default glibc raises its mmap threshold to the size of the last large block freed (up to 32
    MiB), after which multi-MB tensors come from the heap and their memory stays resident after
    they die: the high-water mark would then measure the allocator's retention, not what the code
    holds. Called in a rank before a measured section."""
    import ctypes

    M_MMAP_THRESHOLD = -3
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


@contextlib.contextmanager
def peak_rss() -> Iterator[dict]:
    """{"extra": bytes the resident set rose above its level at entry, at its highest} (filled on exit)."""
    result = {}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = _status_kib("VmRSS")
    yield result
    result["extra"] = (_status_kib("VmHWM") - start) * 1024


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


@contextlib.contextmanager
def collective_calls() -> Iterator[list[tuple[str, object, int]]]:
    """(ProcessGroup method, the group, tensor bytes of its inputs and outputs) of every collective call
    inside the block."""
    cls = torch._C._distributed_c10d.ProcessGroup
    calls: list[tuple[str, object, int]] = []
    originals = {name: getattr(cls, name) for name in _COLLECTIVES if hasattr(cls, name)}

    def counting(name, original):
        def call(self, *args, **kwargs):
            calls.append((name, self, _tensor_bytes(list(args) + list(kwargs.values()))))
            return original(self, *args, **kwargs)
        return call
    for name, original in originals.items():
        setattr(cls, name, counting(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)


@contextlib.contextmanager
def collective_bytes() -> Iterator[list[int]]:
    """The tensor bytes (inputs and outputs) of every collective call inside the block (filled as it ends)."""
    sizes: list[int] = []
    with collective_calls() as calls:
        yield sizes
    sizes.extend(size for _, _, size in calls)
