"""CudaTensor: a tensor that reports `cuda:N` while its values live in a CPU tensor (`_elem`).

Its C++ side is a wrapper on the `meta` device (FakeTensor's trick): a wrapper on `cuda` cannot be
made by a CPU-only build, and one on `cpu` lets C++ code that copies a tensor's options (autograd's
zero-filled gradients, clip_grad_norm_'s grouping by device) make host tensors that nobody sees.
Python sees `cuda:N` through the overridden `device`, `is_cuda`, `is_meta` and `get_device`.
"""
from __future__ import annotations

import threading

import torch

# the current device (torch.cuda.set_device) and whether it was set; the device count
state = {"device": 0, "device_set": False, "count": 1}
on_new = []  # callbacks for each new wrapper (torch_cuda.track: memory statistics)
# the device of the torch call running on a device tensor, if any (see CudaTensor.__torch_function__)
context = threading.local()


class CudaTensor(torch.Tensor):
    """A device tensor: every aten op on it goes through FakeCudaMode (mode.py)."""

    _elem: torch.Tensor
    _index: int

    @staticmethod
    def __new__(cls, elem: torch.Tensor, index: int, requires_grad: bool = False):
        assert type(elem) is torch.Tensor and elem.device.type == "cpu", (type(elem), elem.device)
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device="meta", requires_grad=requires_grad)
        wrapper._elem, wrapper._index = elem, index
        for callback in on_new:
            callback(wrapper)
        return wrapper

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._index)

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def is_meta(self) -> bool:
        return False

    @property
    def is_cpu(self) -> bool:
        return False

    def get_device(self) -> int:
        return self._index

    # the data pointers of the values: DeepSpeed keys buffers and checks aliasing by them
    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    def untyped_storage(self):
        return self._elem.untyped_storage()

    def storage(self):
        return self._elem.storage()

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if not isinstance(new, CudaTensor):
            raise NotImplementedError(
                f"fakecuda: `.data = <{new.device} tensor>` on a cuda tensor (the tier does not model a device "
                f"tensor turning into a host one)")
        torch._C.TensorBase.data.__set__(self, new)  # shape, strides, dtype of the C++ wrapper
        self._elem, self._index = new._elem, new._index

    def tolist(self):
        from tests.support.fakecuda import ledger

        ledger.count_sync("tolist")
        return self._elem.tolist()

    def numpy(self, *, force: bool = False):
        from tests.support.fakecuda import ledger

        raise ledger.refuse(f"can't convert cuda:{self._index} device type tensor to numpy. Use Tensor.cpu() to copy "
                            f"the tensor to host memory first.")

    def __array__(self, dtype=None, copy=None):
        return self.numpy()

    def __repr__(self, *, tensor_contents=None) -> str:
        body = repr(self._elem)  # not counted as a sync: printing is for people
        return body[:-1] + f", device='cuda:{self._index}')" if body.endswith(")") else body

    def __reduce_ex__(self, protocol):
        # torch.save: the values go through the host (a read back, as on CUDA) and load as host tensors
        from tests.support.fakecuda import ledger

        ledger.count_sync("torch.save")
        return self._elem.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["_elem"], {"index": self._index}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return CudaTensor(inner["_elem"], meta["index"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """C++ composites (SDPA's math path, autograd's zero gradients) make tensors with a device
        tensor's options, i.e. on its C++ device, meta: while a torch call on a device tensor runs,
        mode.py makes such factories on that tensor's device instead. No output is converted (torch's
        default would turn a host result, e.g. of .cpu(), into this class)."""
        index = next((a._index for a in args if isinstance(a, CudaTensor)), None)
        if index is None:
            index = next((a._index for a in (kwargs or {}).values() if isinstance(a, CudaTensor)), state["device"])
        previous = getattr(context, "index", None)
        context.index = index
        try:
            with torch._C.DisableTorchFunctionSubclass():
                if func is torch.nn.functional.scaled_dot_product_attention:
                    from tests.support.fakecuda.kernels import sdpa

                    return sdpa(*args, **(kwargs or {}))
                return func(*args, **(kwargs or {}))
        finally:
            context.index = previous

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only where FakeCudaMode is not on the stack (it sees every op first)
        from tests.support.fakecuda.mode import dispatch

        return dispatch(func, args, kwargs or {})


def resolve_index(device) -> int | None:
    """cuda / cuda:N / int (a cuda ordinal) -> N (the current device when none is named); None otherwise."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return state["device"] if device.index is None else device.index
