"""Counting the kernels that make a CUDA stream wait for the host: CUDA's bincount, nonzero,
masked_select, unique and repeat_interleave without output_size read device values to size their
output. Tensor-method counting (tests/dist/test_host_syncs.py) cannot see them; a dispatch mode sees
every aten op, on the CPU too, so a CPU test proves the GPU step free of them."""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_KERNELS = {"aten::bincount", "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
                   "aten::unique_dim", "aten::unique_consecutive", "aten::nonzero_static"}


class KernelSyncs(TorchDispatchMode):
    """`with KernelSyncs() as syncs:` ... then syncs.counts: {kernel: calls} of the kernels above."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SYNCING_KERNELS or (name == "aten::repeat_interleave" and kwargs.get("output_size") is None
                                       and func._overloadname == "Tensor"):
            self.counts[name] += 1
        return func(*args, **kwargs)


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as ops:` ... then ops.total: the aten kernels launched (one each on a GPU)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        return func(*args, **(kwargs or {}))
