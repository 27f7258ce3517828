"""FakeCudaMode: every aten op sees device tensors as CUDA would, and runs on the CPU.

An op on device tensors is checked (one device; a host tensor of more than 0 dims refused as CUDA
refuses it), run by the CPU kernel on the unwrapped values, and its new outputs wrapped again on
that device; in-place and out= ops hand back the caller's own tensors. Reads back to the host are
counted (ledger.py), including kernels that synchronise inside on CUDA. c10d ops given a non-empty
host tensor are refused as NCCL refuses them; gloo then runs on the unwrapped values.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.fakecuda import downloads, kernels, ledger
from tests.support.fakecuda.tensor import CudaTensor, context, resolve_index, state

aten = torch.ops.aten
# CUDA kernels that copy a count or size to the host before they can allocate their output
SYNCING_KERNELS = {
    aten.bincount.default: "bincount", aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique", aten._unique.default: "unique", aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique", aten.equal.default: "equal",
}
# host index tensors are moved to the device by these (allowed under CUDA); the indexed tensor is not
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
FUSED_ADAM = {aten._fused_adam_.default, aten._fused_adamw_.default, aten._fused_adam_.tensor_lr,
              aten._fused_adamw_.tensor_lr, aten._fused_adam.default, aten._fused_adamw.default}
_kinds: dict = {}


def _kind(func) -> str:
    kind = _kinds.get(func)
    if kind is None:
        if func.namespace == "c10d":
            kind = "c10d"
        elif torch.Tag.nondeterministic_seeded in func.tags:
            kind = "random"
        elif torch.Tag.inplace_view in func.tags or func in (aten.set_.source_Tensor, aten.resize_.default,
                                                              aten.set_.source_Storage_storage_offset):
            kind = "inplace_view"
        else:
            kind = "plain"
        _kinds[func] = kind
    return kind


# aten arguments and results nest only lists, tuples and (kwargs) a dict: walked by hand, a third of
# the time torch's pytree takes
def _leaves(obj, out: list) -> list:
    if type(obj) in (list, tuple):
        for x in obj:
            _leaves(x, out)
    elif type(obj) is dict:
        for x in obj.values():
            _leaves(x, out)
    else:
        out.append(obj)
    return out


def _map(fn, obj):
    kind = type(obj)
    if kind is list:
        return [_map(fn, x) for x in obj]
    if kind is tuple:
        return tuple(_map(fn, x) for x in obj)
    if kind is dict:
        return {k: _map(fn, v) for k, v in obj.items()}
    return fn(obj)


def _unwrap(x):
    return x._elem if isinstance(x, CudaTensor) else x


def _same_device_error(a: str, b: str) -> str:
    node = torch._C._current_autograd_node()
    where = f" (in the backward of {node.name()})" if node is not None else ""
    return f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!{where}"


_written: dict = {}


def _written_args(func) -> tuple[set, set]:
    """Positions and names of the arguments an op writes (in place, out=)."""
    found = _written.get(func)
    if found is None:
        arguments = func._schema.arguments
        writes = [(i, a.name, a.kwarg_only) for i, a in enumerate(arguments)
                  if a.alias_info is not None and a.alias_info.is_write]
        found = _written[func] = ({i for i, _, kw in writes if not kw}, {n for _, n, _ in writes})
    return found


def _check_devices(func, flat: list, indices: set, args: tuple = (), kwargs: dict | None = None) -> None:
    """CUDA's rule: one device per op; a host tensor only as a 0-dim scalar input (not even that in
    fused Adam), never as the tensor an op writes."""
    if len(indices) > 1:
        a, b = sorted(indices)[:2]
        raise ledger.refuse(f"{func}: " + _same_device_error(f"cuda:{a}", f"cuda:{b}"))
    index = next(iter(indices))
    strict = func in FUSED_ADAM
    for x in flat:
        if isinstance(x, torch.Tensor) and not isinstance(x, CudaTensor):
            if x.device.type == "meta" or strict or x.dim() > 0:
                raise ledger.refuse(f"{func}: " + _same_device_error(f"cuda:{index}", str(x.device)))
    positions, names = _written_args(func)
    written = [args[i] for i in positions if i < len(args)] + [v for k, v in (kwargs or {}).items() if k in names]
    for x in _leaves(written, []):
        if isinstance(x, torch.Tensor) and not isinstance(x, CudaTensor):
            raise ledger.refuse(f"{func}: " + _same_device_error(f"cuda:{index}", f"{x.device} (written)"))


def _check_indexing(func, args, kwargs, indices: set) -> None:
    self_ = args[0]
    if not isinstance(self_, CudaTensor):
        raise ledger.refuse(f"{func}: indices should be either on cpu or on the same device as the indexed tensor (cpu)")
    rest = [a for i, a in enumerate(args) if i != 1] + list(kwargs.values())
    _check_devices(func, _leaves(rest, []), indices)
    if any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1] if t is not None):
        ledger.count_sync("boolean-mask index (nonzero)")


def _check_collective(func, flat: list) -> None:
    """NCCL takes CUDA tensors on this rank's device only, after torch.cuda.set_device."""
    for x in flat:
        if isinstance(x, torch.Tensor) and not isinstance(x, CudaTensor) and x.numel() > 0:
            raise ledger.refuse(f"{func}: Tensors must be CUDA and dense (a {x.device} tensor of shape "
                                f"{tuple(x.shape)} in a collective: NCCL refuses host tensors)")
        if isinstance(x, CudaTensor):
            if not state["device_set"] and state["count"] > 1:
                raise ledger.refuse(f"{func}: a collective before torch.cuda.set_device: every rank of the node "
                                    f"would use cuda:0 (NCCL: Duplicate GPU detected)")
            if x._index != state["device"]:
                raise ledger.refuse(f"{func}: a tensor on cuda:{x._index} in a collective of a rank whose device "
                                    f"is cuda:{state['device']}")


@contextlib.contextmanager
def _cuda_generator(index: int):
    """Run a random op with the CPU's default generator holding the device's generator state."""
    from tests.support.fakecuda.rng import generators

    device_gen, host = generators()[index], torch.default_generator
    saved = host.get_state()
    host.set_state(device_gen.get_state())
    try:
        yield
    finally:
        device_gen.set_state(host.get_state())
        host.set_state(saved)


def _target(kwargs: dict, flat: list):
    """The device a factory or copy names: ('cuda', N), ('host', None), ('other', None) (meta), or None
    when it names none. `meta` is the C++ device of every device tensor, so C++ code that copies a
    device tensor's options names meta: such an op goes to that tensor's device, and so does a pure
    factory inside a torch call on a device tensor (tensor.py)."""
    device = kwargs.get("device")
    if device is None:
        return None
    index = resolve_index(device)
    if index is not None:
        return ("cuda", index)
    if torch.device(device).type == "meta":
        # C++ passing a device tensor's options (ToCopyBackward's grad.to(self.options()), factories in
        # composites): that tensor's device. An explicit x.to("meta") never gets here (torch_cuda.py).
        on_device = next((x._index for x in flat if isinstance(x, CudaTensor)), None)
        if on_device is not None:
            return ("cuda", on_device)
        inside = getattr(context, "index", None)
        if inside is not None and not any(isinstance(x, torch.Tensor) for x in flat):
            return ("cuda", inside)
    return ("host" if torch.device(device).type == "cpu" else "other", None)


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    kind = _kind(func)
    flat = _leaves(kwargs, _leaves(args, []))
    indices = {x._index for x in flat if isinstance(x, CudaTensor)}
    target = _target(kwargs, flat)
    if kind == "c10d" and func is not torch.ops.c10d.barrier.default:  # (gloo's barrier tensor is its own)
        _check_collective(func, flat)
    if not indices and (target is None or target[0] != "cuda"):
        if kind == "random" and isinstance(kwargs.get("generator"), torch.Generator):
            _check_generator(func, kwargs["generator"], on_device=False)
        return func(*args, **kwargs)  # a host op
    handler = kernels.HANDLERS.get(func)
    if handler is not None:
        ledger.kernels[str(func)] += 1
        return handler(func, args, kwargs, next(iter(indices), None))
    if func is aten._local_scalar_dense.default:
        ledger.count_sync("item")
        return args[0]._elem.item()
    if func is aten.copy_.default:
        return _copy(args, kwargs)
    if func is aten._to_copy.default and target is not None and target[0] == "host":
        ledger.count_sync("to host")
    elif func is aten._to_copy.default and not indices and target is not None:  # host tensor to the device
        ledger.count_upload(args[0].numel() * args[0].element_size())
        _count_blocking_upload(args[0], kwargs.get("non_blocking", False))
    elif func in INDEXING:
        _check_indexing(func, args, kwargs, indices)
    elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and len(args) < 2:
        ledger.count_sync("repeat_interleave without output_size")
    elif func is not aten._to_copy.default and indices and kind != "c10d":
        _check_devices(func, flat, indices, args, kwargs)
    if func in SYNCING_KERNELS:
        ledger.count_sync(SYNCING_KERNELS[func])
    if func is aten.record_stream.default:
        return None  # one stream per device here: nothing to record
    index = target[1] if target is not None and target[0] == "cuda" else next(iter(indices), None)
    by_id = {id(x._elem): x for x in flat if isinstance(x, CudaTensor)}
    args, kwargs = _map(_unwrap, args), _map(_unwrap, kwargs)
    if target is not None:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if kind == "random" and index is not None:
        out = _random(func, args, kwargs, index)
    else:
        out = func(*args, **kwargs)
    if target is not None and target[0] != "cuda":
        index = None
    result = _rewrap(out, by_id, index)
    if kind == "inplace_view":
        refresh(by_id.get(id(args[0])))
    return result


def _rewrap(out, by_id: dict, index):
    def rewrap(x):
        if type(x) is torch.Tensor:
            known = by_id.get(id(x))
            if known is not None:
                return known
            if index is not None and x.device.type == "cpu":
                return CudaTensor(x, index)
        return x
    return _map(rewrap, out)


def refresh(wrapper) -> None:
    """After an op that changed the values' shape or strides in place: the wrapper's C++ side follows."""
    if isinstance(wrapper, CudaTensor):
        elem = wrapper._elem
        if wrapper.shape != elem.shape or wrapper.stride() != elem.stride() or \
                wrapper.storage_offset() != elem.storage_offset():
            torch._C.TensorBase.data.__set__(wrapper, CudaTensor(elem, wrapper._index))


def _count_blocking_upload(src: torch.Tensor, non_blocking: bool) -> None:
    """A host-to-device copy the host waits for: CUDA's copy synchronises the stream unless it is
    non_blocking from page-locked memory (a pageable source is staged after a stream sync), so the
    host stops until the device has run everything queued before it, as a read back would."""
    if not (non_blocking and src.is_pinned()):
        ledger.count_sync("blocking upload")


def _copy(args, kwargs):
    """copy_(dst, src): host to device and device to host are copies, not mixing (the latter a read back)."""
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if isinstance(dst, CudaTensor) and isinstance(src, CudaTensor) and dst._index != src._index:
        pass  # peer copy: allowed on CUDA
    elif not isinstance(dst, CudaTensor):
        if non_blocking and isinstance(src, CudaTensor) and dst.is_pinned():
            downloads.queue(dst, src._elem)  # the host does not wait: it lands at the next wait (downloads.py)
            return dst
        ledger.count_sync("copy_ to host")
    elif not isinstance(src, CudaTensor) and isinstance(src, torch.Tensor) and src.device.type == "cpu":
        ledger.count_upload(src.numel() * src.element_size())
        _count_blocking_upload(src, non_blocking)
    if isinstance(src, torch.Tensor) and src.device.type == "meta" and not isinstance(src, CudaTensor):
        raise ledger.refuse("copy_: " + _same_device_error(str(dst.device), "meta"))
    dst_elem = dst._elem if isinstance(dst, CudaTensor) else dst
    src_elem = src._elem if isinstance(src, CudaTensor) else src
    dst_elem.copy_(src_elem, non_blocking)
    return dst


def _check_generator(func, generator: torch.Generator, on_device: bool, index: int | None = None) -> None:
    from tests.support.fakecuda.rng import is_device_generator

    ours = is_device_generator(generator, index)
    if on_device and not ours:
        raise ledger.refuse(f"{func}: Expected a 'cuda' device type for generator but found 'cpu'")
    if not on_device and ours:
        raise ledger.refuse(f"{func}: Expected a 'cpu' device type for generator but found 'cuda'")


def _random(func, args, kwargs, index: int):
    generator = kwargs.get("generator")
    if generator is not None:
        _check_generator(func, generator, on_device=True, index=index)
        return func(*args, **kwargs)  # the device generator itself (a CPU generator object) draws
    with _cuda_generator(index):
        return func(*args, **kwargs)


class FakeCudaMode(TorchDispatchMode):
    """Pushed once per process (install.py) and left on: every aten op passes here first."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):
            # another tensor subclass (FSDP2's DTensor) dispatches first: its ops on its local
            # tensors then come back here, where the local tensors are the device's own
            return NotImplemented
        return dispatch(func, args, kwargs or {})
