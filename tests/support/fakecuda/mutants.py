"""Seeded bugs in megaframe, for the tier's own tests: MEGAFRAME_FAKE_CUDA_MUTANT=NAME makes every
process of a run carry one (sitecustomize.py applies it after installing the device). Each is a bug
that passes on the CPU and fails, or syncs per micro-batch, on CUDA; the tier must notice it."""
from __future__ import annotations

import torch


def _init_on_default_device() -> None:
    """Initial values drawn without device= (megaframe before a910607): under ZeRO-3's zero.Init the
    factory lands on the accelerator, which refuses the CPU generator."""
    from megaframe.model import init_values

    def drawn_on_default_device(seed, name, lead, row, col, generator=None):
        key = f"{name}#{'.'.join(map(str, lead))}#{row}.{col}"
        generator = torch.Generator().manual_seed(init_values.name_seed(seed, key))
        return torch.randn(init_values.TILE_ROWS, init_values.TILE_COLS, generator=generator)
    init_values.draw_tile = drawn_on_default_device


def _host_dp_mean() -> None:
    """The step's loss all-reduced from a host copy (gloo takes it; NCCL refuses it)."""
    import torch.distributed as dist

    from megaframe.backends.deepspeed.engine import DeepSpeedBackend

    def dp_mean(self, value):
        t = value.detach().to(torch.float64).reshape(1).cpu()
        replicas = self.ps.grid.size("dp", "cp")
        if replicas > 1:
            dist.all_reduce(t, group=self.ps.grad_reduce_group)
        return (t / replicas).item()
    DeepSpeedBackend._dp_mean = dp_mean


def _item_per_micro_batch() -> None:
    """Each micro-batch's loss read on the host as it is summed (a sync per micro-batch)."""
    from megaframe.backends.deepspeed import skip_gate

    call = skip_gate.LastMicroBatchGate.__call__

    def read_each(self, loss):
        float(loss.detach())
        return call(self, loss)
    skip_gate.LastMicroBatchGate.__call__ = read_each


def _adam_step_on_host() -> None:
    """A resumed Adam step kept on the host (megaframe before a910607): fused AdamW reads it on the device."""
    from megaframe.backends.deepspeed import state_io

    state_io.adam_step_tensor = lambda step, param, on_device: torch.tensor(float(step))


MUTANTS = {"adam_step_on_host": _adam_step_on_host, "init_on_default_device": _init_on_default_device, "host_dp_mean": _host_dp_mean,
           "item_per_micro_batch": _item_per_micro_batch}


def apply(name: str) -> None:
    MUTANTS[name]()
