"""The torch surface outside the dispatcher: torch.cuda (devices, streams, events, memory, RNG) and the
few Python-level torch functions that would otherwise see the wrappers' C++ `meta` device."""
from __future__ import annotations

import contextlib
import os
import threading
import time
import types
import weakref

import torch

from tests.support.fakecuda import downloads, rng
from tests.support.fakecuda.tensor import CudaTensor, resolve_index, state

TOTAL_MEMORY = 80 * 2**30
NAME = "NVIDIA H100 80GB HBM3"
_memory = {"allocated": 0, "peak": 0}
_live: dict[int, list] = {}  # storage data_ptr -> [bytes, wrappers alive]


# ---- devices ----------------------------------------------------------------------------------
def set_device(device) -> None:
    index = resolve_index(device)
    if index is None or not 0 <= index < state["count"]:
        raise RuntimeError(f"CUDA error: invalid device ordinal ({device!r}; {state['count']} devices)")
    state["device"], state["device_set"] = index, True


def current_device() -> int:
    return state["device"]


def device_count() -> int:
    return state["count"]


def get_device_capability(device=None) -> tuple[int, int]:
    return (9, 0)


def get_device_name(device=None) -> str:
    return NAME


def get_device_properties(device=None):
    return types.SimpleNamespace(name=NAME, major=9, minor=0, total_memory=TOTAL_MEMORY, multi_processor_count=132,
                                 is_integrated=False, is_multi_gpu_board=False, L2_cache_size=50 * 2**20)


class device:
    """torch.cuda.device(i): the current device inside the block."""

    def __init__(self, device):
        self.index = resolve_index(device) if device is not None and device != -1 else None

    def __enter__(self):
        self.previous = state["device"]
        if self.index is not None:
            state["device"] = self.index

    def __exit__(self, *exc):
        state["device"] = self.previous
        return False


# ---- streams and events: one in-order stream per device; waiting is free ----------------------
class Stream(torch.Stream):
    """A CUDA stream that is always idle (the CPU runs every op when it is issued)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        return super().__new__(cls, device="cpu")

    def wait_stream(self, stream) -> None:
        downloads.wait(self, stream)

    def wait_event(self, event) -> None:
        if event.stream is not None:
            downloads.wait(self, event.stream, event.covers)

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        downloads.land(self)

    def query(self) -> bool:
        downloads.land(self)  # True: the host may now read what was queued on it
        return True

    @property
    def cuda_stream(self) -> int:
        return 0


class Event:
    """A CUDA event: recorded at the host's time (every op has finished by then, but the non-blocking
    downloads queued before it, which land when the host waits on it: downloads.py)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.time = None
        self.stream, self.covers = None, 0  # where it was recorded, after which of the downloads queued

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()
        self.stream, self.covers = stream if stream is not None else current_stream(), downloads.issued()

    def wait(self, stream=None) -> None:  # a stream waiting on the device: the host does not
        if self.stream is not None:
            downloads.wait(stream if stream is not None else current_stream(), self.stream, self.covers)

    def query(self) -> bool:
        if self.stream is not None:
            downloads.land(self.stream, self.covers)
        return True

    def synchronize(self) -> None:
        if self.stream is not None:
            downloads.land(self.stream, self.covers)

    def elapsed_time(self, end: "Event") -> float:
        return (end.time - self.time) * 1000.0


_stream = None
_selected = threading.local()  # the stream `with torch.cuda.stream(s)` made current on this thread


def current_stream(device=None) -> Stream:
    global _stream
    selected = getattr(_selected, "stream", None)
    if selected is not None:
        return selected
    if _stream is None:
        _stream = Stream()
    return _stream


def default_stream(device=None) -> Stream:
    global _stream
    if _stream is None:
        _stream = Stream()
    return _stream


@contextlib.contextmanager
def stream(s=None):
    previous = getattr(_selected, "stream", None)
    if s is not None:
        _selected.stream = s
    try:
        yield
    finally:
        _selected.stream = previous


def synchronize(device=None) -> None:
    downloads.land()


# ---- memory: bytes of the device tensors' storages alive ---------------------------------------
def track(wrapper: CudaTensor) -> None:
    storage = wrapper._elem.untyped_storage()
    key = storage.data_ptr()
    if not key:
        return
    entry = _live.get(key)
    if entry is None:
        entry = _live[key] = [storage.nbytes(), 0]
        _memory["allocated"] += entry[0]
        _memory["peak"] = max(_memory["peak"], _memory["allocated"])
    entry[1] += 1
    weakref.finalize(wrapper._elem, _release, key)  # not the wrapper: swap_tensors refuses weakly referenced tensors


def _release(key: int) -> None:
    entry = _live.get(key)
    if entry is not None:
        entry[1] -= 1
        if entry[1] == 0:
            _memory["allocated"] -= entry[0]
            del _live[key]


def memory_allocated(device=None) -> int:
    return _memory["allocated"]


def max_memory_allocated(device=None) -> int:
    return _memory["peak"]


def reset_peak_memory_stats(device=None) -> None:
    _memory["peak"] = _memory["allocated"]


def memory_stats(device=None) -> dict:
    return {"allocated_bytes.all.current": _memory["allocated"], "allocated_bytes.all.peak": _memory["peak"],
            "reserved_bytes.all.current": _memory["allocated"], "reserved_bytes.all.peak": _memory["peak"]}


def mem_get_info(device=None) -> tuple[int, int]:
    return TOTAL_MEMORY - _memory["allocated"], TOTAL_MEMORY


def _noop(*args, **kwargs):
    return None


def install_torch_cuda() -> None:
    """torch.cuda as a CUDA build with state['count'] H100s would present it."""
    cuda = torch.cuda
    state["count"] = int(os.environ.get("MEGAFRAME_FAKE_CUDA_DEVICES", "8"))
    for f in (set_device, current_device, device_count, get_device_capability, get_device_name,
              get_device_properties, current_stream, stream, synchronize, memory_allocated, max_memory_allocated,
              reset_peak_memory_stats, memory_stats, mem_get_info):
        setattr(cuda, f.__name__, f)
    cuda.device, cuda.Stream, cuda.Event = device, Stream, Event
    cuda.default_stream = default_stream
    cuda.set_stream = _noop
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda._lazy_init = _noop  # the C++ factories call it before a cuda allocation
    cuda.is_bf16_supported = lambda *a, **k: True
    cuda.empty_cache = _noop
    cuda.memory_reserved = cuda.memory_cached = memory_allocated
    cuda.max_memory_reserved = cuda.max_memory_cached = max_memory_allocated
    cuda.reset_max_memory_allocated = cuda.reset_max_memory_cached = reset_peak_memory_stats
    cuda.reset_accumulated_memory_stats = _noop
    cuda.memory_summary = lambda *a, **k: f"fakecuda: {_memory['allocated']} bytes allocated"
    cuda.nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, mark=_noop,
                                      range=lambda *a, **k: contextlib.nullcontext())
    rng.install(cuda)
    # sm90 with FlashAttention-2 and memory-efficient attention built in (kernels.py emulates both)
    torch.backends.cuda.is_flash_attention_available = lambda: True


# ---- Python-level torch functions that read the C++ device -------------------------------------
def install_torch_functions() -> None:
    # torch.tensor(data, device="cuda") builds on the host and moves through the dispatcher
    torch._C._set_only_lift_cpu_tensors(True)
    _patch_to()
    _patch_grouping()
    _patch_swap_tensors()
    _patch_object_collectives()
    _patch_pinning()
    _patch_dtensor()


def _patch_dtensor() -> None:
    """FSDP2's DTensor around a device tensor: its C++ side is a wrapper on `meta` (made from the
    local tensor's C++ side), so, as for CudaTensor, Python must see the local tensor's device."""
    from torch.distributed.tensor import DTensor

    from tests.support.fakecuda.tensor import CudaTensor

    base_device = torch.Tensor.device

    def on_device(self) -> bool:
        return isinstance(self._local_tensor, CudaTensor)

    DTensor.device = property(lambda self: self._local_tensor.device if on_device(self) else base_device.__get__(self))
    DTensor.is_cuda = property(lambda self: on_device(self) or torch.Tensor.is_cuda.__get__(self))
    DTensor.is_meta = property(lambda self: not on_device(self) and torch.Tensor.is_meta.__get__(self))


def _patch_pinning() -> None:
    """Tensor.pin_memory / is_pinned: a CPU-only build has no pinned allocator ("Cannot access
    accelerator device when none is available"). As on CUDA: a host tensor pins into a page-locked
    copy (here a plain one, remembered as pinned); a device tensor cannot be pinned."""
    import weakref

    # by storage, as CUDA's page-locked memory is a property of the storage: a view of a pinned tensor
    # (FSDP2 narrows its padded shard) is pinned too. Forgotten when the pinned copy goes.
    pinned: set[int] = set()

    def storage(tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    def pin_memory(self, device=None):
        if isinstance(self, CudaTensor):
            raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
        copy = self.clone(memory_format=torch.contiguous_format)
        pinned.add(storage(copy))
        weakref.finalize(copy, pinned.discard, storage(copy))
        return copy

    def is_pinned(self, device=None):
        if isinstance(self, CudaTensor) or self.is_meta:
            return False
        try:
            return storage(self) in pinned
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
            return False

    torch.Tensor.pin_memory, torch.Tensor.is_pinned = pin_memory, is_pinned
    empty = torch.empty

    def empty_pinnable(*args, pin_memory: bool = False, **kwargs):
        """torch.empty(..., pin_memory=True): page-locked host memory (here remembered as pinned)."""
        tensor = empty(*args, **kwargs)
        if pin_memory:
            if isinstance(tensor, CudaTensor):
                raise RuntimeError("pin_memory=True: only dense CPU tensors can be pinned")
            pinned.add(storage(tensor))
            weakref.finalize(tensor, pinned.discard, storage(tensor))
        return tensor

    torch.empty = empty_pinnable


def _indexed(device):
    """'cuda' -> cuda:N (the current device): C++ asks a CUDA device guard for the index, which a
    CPU-only build lacks ("not linked with support for cuda devices")."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cuda", resolve_index(device))
    return device


def _patch_to() -> None:
    """Tensor.to / .cuda / .new_tensor, torch.tensor / as_tensor: a cuda device gets its index; .to
    returns the tensor itself when nothing changes (C++ would compare the wrapper's meta device)."""
    to, parse = torch.Tensor.to, torch._C._nn._parse_to

    def to_device(self, *args, **kwargs):
        copy = kwargs.pop("copy", False)
        if args and isinstance(args[0], torch.Tensor):  # to(other, non_blocking=False, copy=False)
            args = (args[0].device, args[0].dtype, *args[1:])
        if len(args) > 3:  # to(device, dtype, non_blocking, copy)
            copy, args = args[3], args[:3]
        try:
            device, dtype, non_blocking, memory_format = parse(*args, **kwargs)
        except Exception:
            return to(self, *args, copy=copy, **kwargs)
        device = _indexed(device)
        if isinstance(self, CudaTensor) and device is not None and device.type == "meta":
            # explicit: a meta tensor (the dispatcher would read `meta` as this tensor's own device)
            return self._elem.to(device, dtype or self.dtype)
        memory_format = torch.preserve_format if memory_format is None else memory_format
        if (isinstance(self, CudaTensor) and not copy and device in (None, self.device)
                and dtype in (None, self.dtype) and memory_format is torch.preserve_format):
            return self
        return to(self, device, dtype, non_blocking, copy, memory_format=memory_format)

    def to_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return to_device(self, _indexed("cuda" if device is None else device), non_blocking=non_blocking,
                         memory_format=memory_format)

    def from_data(make):
        def made(data, *args, device=None, **kwargs):
            return make(data, *args, device=_indexed(device), **kwargs)
        return made

    new_tensor = torch.Tensor.new_tensor

    def new_tensor_here(self, data, dtype=None, device=None, requires_grad=False, **kwargs):
        if isinstance(self, CudaTensor):  # C++ would use the wrapper's meta device
            device, dtype = device or self.device, dtype or self.dtype
            return torch.tensor(data, dtype=dtype, device=_indexed(device), requires_grad=requires_grad)
        return new_tensor(self, data, dtype=dtype, device=_indexed(device), requires_grad=requires_grad, **kwargs)

    torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.new_tensor = to_device, to_cuda, new_tensor_here
    torch.tensor, torch.as_tensor = from_data(torch.tensor), from_data(torch.as_tensor)


def _patch_grouping() -> None:
    """The foreach helpers group tensors by the C++ device (meta for every device tensor): regroup
    those groups by the device each tensor reports."""
    group = torch._C._group_tensors_by_device_and_dtype

    def regrouped(tensorlistlist, with_indices=False):
        grouped = group(tensorlistlist, with_indices)
        out = {}
        for (dev, dtype), (lists, indices) in grouped.items():
            if dev.type != "meta":
                out[(dev, dtype)] = (lists, indices)
                continue
            for position, t in enumerate(lists[0]):
                key = (t.device, dtype)
                bucket = out.setdefault(key, ([[] for _ in lists], []))
                for i, tensors in enumerate(lists):
                    bucket[0][i].append(tensors[position] if tensors else None)
                bucket[1].append(indices[position] if indices else None)
        return {k: ([l if any(x is not None for x in l) else [] for l in v[0]], v[1] if with_indices else [])
                for k, v in out.items()}

    torch._C._group_tensors_by_device_and_dtype = regrouped


def _patch_swap_tensors() -> None:
    """Module.to("cuda") swaps each parameter with its device copy (a wrapper subclass): the Parameter
    object stays the module's, as `param.data = cuda_copy` keeps it on a CUDA build, with the
    attributes other code put on it (DeepSpeed's ds_*, shard marks, tied weights) and the weak
    references others hold to it (torch's swap_tensors refuses those, and would hand the attributes to
    the discarded copy)."""
    swap = torch.utils.swap_tensors

    def swap_to_device(t1, t2):
        if isinstance(t1, CudaTensor) and isinstance(t2, CudaTensor):
            CudaTensor.data.fset(t1, t2)  # a cast or a second visit of a tied weight: `param.data = applied`
            return None
        if not (isinstance(t2, CudaTensor) and type(t1) in (torch.Tensor, torch.nn.Parameter)):
            return swap(t1, t2)
        for t, name in ((t1, "t1"), (t2, "t2")):
            if t._use_count() > 1 and not (t._use_count() == 2 and t.is_leaf):
                raise RuntimeError(f"Expected use_count of {name} to be 1 or 2 with an AccumulateGrad node but got "
                                   f"{t._use_count()}")
        kept = dict(t1.__dict__)
        t1.__class__, t2.__class__ = t2.__class__, t1.__class__
        t1.__dict__, t2.__dict__ = t2.__dict__, t1.__dict__
        torch._C._swap_tensor_impl(t1, t2)
        for k, v in kept.items():
            t1.__dict__.setdefault(k, v)

    torch.utils.swap_tensors = swap_to_device


def _patch_object_collectives() -> None:
    """broadcast_object_list and friends stage their bytes on the current CUDA device under NCCL."""
    from torch.distributed import distributed_c10d

    distributed_c10d._get_object_coll_device = lambda group=None: f"cuda:{state['device']}"
    distributed_c10d._get_pg_default_device = lambda group=None: torch.device("cuda", state["device"])
