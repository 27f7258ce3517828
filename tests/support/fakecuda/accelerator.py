"""DeepSpeed's view of the device: its CPU accelerator renamed `cuda` (devices `cuda:N`), with gloo for
collectives, torch.cuda's RNG, streams, events and memory, and typed constructors that make device
tensors. is_synchronized_device() is False by default, as on a GPU: DeepSpeed then takes its GPU code
paths (reduction streams, record_stream, events as timers); MEGAFRAME_FAKE_CUDA_SYNCHRONIZED=1 makes
it True (the CPU's paths) so both can be tested."""
from __future__ import annotations

import os

import torch
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from tests.support.fakecuda.tensor import state


def _typed(dtype: torch.dtype):
    def make(*args, **kwargs):
        # ByteTensor([1]) / FloatTensor(3, 4) / FloatTensor(): a device tensor as torch.cuda.*Tensor makes
        device = torch.device("cuda", state["device"])
        if len(args) == 1 and not isinstance(args[0], int):
            return torch.tensor(args[0], dtype=dtype, device=device)
        return torch.empty(*args, dtype=dtype, device=device)
    return make


class FakeCudaAccelerator(CPU_Accelerator):
    """DeepSpeed's CUDA accelerator as this tier can offer it."""

    def __init__(self):
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = "gloo"  # the stand-in for nccl
        self.synchronized = os.environ.get("MEGAFRAME_FAKE_CUDA_SYNCHRONIZED") == "1"

    def is_synchronized_device(self):
        return self.synchronized

    def use_host_timers(self):
        return self.synchronized

    def resolves_data_dependency(self):
        return self.synchronized

    def handles_memory_backpressure(self):
        return self.synchronized

    # devices
    def device_name(self, device_index=None):
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.cuda.device(device_index)

    def set_device(self, device_index):
        torch.cuda.set_device(device_index)

    def current_device(self):
        return torch.cuda.current_device()

    def current_device_name(self):
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self):
        return torch.cuda.device_count()

    def synchronize(self, device_index=None):
        torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor):
        return tensor.device.type == "cuda"

    # RNG
    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def manual_seed(self, seed):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self):
        return torch.cuda.initial_seed()

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index]

    # streams and events
    @property
    def Stream(self):
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):
        return torch.cuda.Event

    # memory
    def memory_allocated(self, device_index=None):
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None):
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        torch.cuda.reset_peak_memory_stats(device_index)

    # the device keeps no cache: cached and reserved memory are the allocated memory
    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None):
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index=None):
        return torch.cuda.mem_get_info()[1]

    def available_memory(self, device_index=None):
        return torch.cuda.mem_get_info()[0]

    def get_op_builder(self, class_name):
        # a GPU has no shared-memory or oneCCL collectives (NCCL does that); the rest (CPU Adam for
        # offload, async IO) are the CPU's, as DeepSpeed's CUDA accelerator also builds them for the host
        if class_name in ("ShareMemCommBuilder", "CCLCommBuilder"):
            return None
        return super().get_op_builder(class_name)

    def is_fp16_supported(self):
        return True

    def supported_dtypes(self):
        return [torch.float, torch.bfloat16, torch.float16]

    # legacy typed constructors
    BFloat16Tensor = property(lambda self: _typed(torch.bfloat16))
    ByteTensor = property(lambda self: _typed(torch.uint8))
    DoubleTensor = property(lambda self: _typed(torch.float64))
    FloatTensor = property(lambda self: _typed(torch.float32))
    HalfTensor = property(lambda self: _typed(torch.float16))
    IntTensor = property(lambda self: _typed(torch.int32))
    LongTensor = property(lambda self: _typed(torch.int64))


def install() -> FakeCudaAccelerator:
    from deepspeed.accelerator import set_accelerator

    accelerator = FakeCudaAccelerator()
    set_accelerator(accelerator)
    return accelerator
