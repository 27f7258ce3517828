"""The CUDA-shaped CPU device: tensors report `cuda:N`, run on the CPU, and fail where CUDA or NCCL
would (a host tensor meeting a device tensor or entering a collective, a CPU generator drawing for a
device tensor); reads back to the host are counted with their call sites.

install() sets it up in this process; tests/support/fakecuda/sitecustomize.py calls it in every Python
process started with MEGAFRAME_FAKE_CUDA=1 and tests/support/fakecuda on PYTHONPATH (megaframe-train's
ranks, torchrun's, forked ones). It lives with the tests: megaframe never imports it.

  tensor.py       CudaTensor, the wrapper (meta on the C++ side, cuda:N in Python)
  mode.py         FakeCudaMode: checks, runs on the CPU, rewraps; counts syncs; refuses host tensors in c10d
  kernels.py      CUDA-only kernels emulated (SDPA choice, flash / efficient attention, grouped GEMM)
  rng.py          the device generators
  torch_cuda.py   torch.cuda and the Python-level torch functions that read the C++ device
  accelerator.py  DeepSpeed's accelerator named cuda, gloo underneath
  ledger.py       violations and syncs, with call sites; per-process reports
  downloads.py    non-blocking copies into page-locked memory, landed when the host waits for them
"""
from __future__ import annotations

from tests.support.fakecuda import ledger

_installed = {"done": False, "mode": None}


def install(deepspeed: bool = True) -> None:
    """Make this process see CUDA devices (idempotent). deepspeed=False leaves DeepSpeed's accelerator
    alone (and DeepSpeed unimported)."""
    if _installed["done"]:
        return
    import torch

    from tests.support.fakecuda import torch_cuda
    from tests.support.fakecuda.mode import FakeCudaMode
    from tests.support.fakecuda.tensor import on_new

    torch_cuda.install_torch_cuda()
    torch_cuda.install_torch_functions()
    on_new.append(torch_cuda.track)
    mode = FakeCudaMode()
    mode.__enter__()  # left on for the life of the process (forked children inherit it)
    _installed.update(done=True, mode=mode)
    if deepspeed:
        import os

        from tests.support.fakecuda.accelerator import install as install_accelerator

        # DeepSpeed picks an accelerator while it is imported: its CPU one (under this variable),
        # which install_accelerator then replaces with the fake `cuda` one. The variable goes after,
        # as on a GPU host: what megaframe runs without DeepSpeed (backends/plain/) reads it as
        # "train on the host" and would not see the device
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        install_accelerator()
        os.environ.pop("DS_ACCELERATOR")
    ledger.write_report_at_exit()
    assert torch.cuda.is_available()
