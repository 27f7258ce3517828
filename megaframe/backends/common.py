"""What every engine's backend does the same way, whichever library runs the step: the process
group's defaults, the rank's device, the parameter groups, the micro-batches' device copies, the
data-parallel mean of a loss, the MoE router's metrics and the model's checkpoint parts (router
biases, the TP dropout stream). An engine's folder keeps only what its library decides."""
from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megaframe.backends import Batch
from megaframe.checkpoint.parts import Resume
from megaframe.data.dataset import IGNORED_TARGET
from megaframe.model.dims import GPTDims
from megaframe.model.masking import StepTargets
from megaframe.model.moe import load_router_biases, router_biases
from megaframe.optim.groups import decay_param_groups  # noqa: F401  (the seam's; engines and tools import it here)
from megaframe.optim.state import ensure_state, step_tensor
from megaframe.optim.table import ALL_TENSOR_STATE
from megaframe.parallel.random import TPDropoutRNG
from megaframe.parallel.rendezvous import bound_device, free_port, join_world
from megaframe.parallel.state import ParallelState


def set_collective_timeout(timeout: timedelta) -> None:
    """Make `timeout` the default of every process group created from now on: ours, and those an
    engine creates without passing one (torch would give them 30 min, NCCL's 10)."""
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def process_group_defaults(collective_timeout_s: Optional[float]) -> timedelta:
    """Before any engine joins its process group: a world of one when no launcher set one up (its
    own rendezvous port), and megaframe's collective timeout as the default of every group created
    from now on. Returns the timeout the engine passes to its own init."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if not collective_timeout_s:
        return distributed_c10d.default_pg_timeout
    timeout = timedelta(seconds=collective_timeout_s)
    set_collective_timeout(timeout)
    return timeout


def join_torch_world(device_type: str, collective_timeout_s: Optional[float],
                     join_timeout_s: Optional[float] = None) -> None:
    """How an engine without a library of its own (FSDP2, plain) joins its process group: this rank's
    device first (before any collective creates a communicator on device 0), NCCL on CUDA wherever
    torch has it (gloo moves CUDA tensors too, slowly), a torchrun restart under its attempt's
    prefix, else the launcher's group (parallel/rendezvous.py: every rank awaited within
    join_timeout_s) or a world of one."""
    timeout = process_group_defaults(collective_timeout_s)
    backend = "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
        backend = "nccl" if dist.is_nccl_available() else "gloo"
    join_world(backend, timeout, join_timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, device_id=bound_device(backend))


def local_device_index(local_rank: int, visible_devices: int) -> int:
    """The device this rank drives. LOCAL_RANK counts the node's ranks, but SLURM's --gpus-per-task
    / --gpu-bind and Ray give each rank its own CUDA_VISIBLE_DEVICES: one visible device, on which
    device LOCAL_RANK does not exist. Each rank takes its share of what it sees."""
    return local_rank % visible_devices if visible_devices > 0 else local_rank


def pinned_offload(setting: Optional[bool], device: torch.device) -> bool:
    """offload.pin_memory as the engine gets it: null pins on a GPU, where unpinned host buffers make
    every offloaded copy synchronous (no prefetch overlaps compute), and not on the CPU."""
    return device.type != "cpu" if setting is None else setting


def dp_mean(value: torch.Tensor, ps: ParallelState) -> float:
    """Mean of a 0-d device tensor over the dp x cp ranks (each holds a like share of the step's
    tokens: its samples, or under cp its zig-zag shard of them): one host read."""
    t = value.detach().to(torch.float64).reshape(1)
    replicas = ps.grid.size("dp", "cp")
    if replicas > 1:
        dist.all_reduce(t, group=ps.grad_reduce_group)
    return (t / replicas).item()


def on_device(batches: list[Batch], device: torch.device) -> list[Batch]:
    """The micro-batches on this rank's device (no copy where they already are). From pinned host
    memory, so the copies are asynchronous on a GPU. Pinned by torch itself: DeepSpeed's
    accelerator.pin_memory adds every call to a process-wide total that never shrinks and logs
    "crossed 32 GB pinned" after a few hours of micro-batches that were each freed long ago."""
    return [(to_device(inputs, device), to_device(targets, device)) for inputs, targets in batches]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One tensor as on_device moves it."""
    if t.device == device:
        return t
    if device.type == "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def step_targets_of(holder: StepTargets, dims: GPTDims) -> Optional[StepTargets]:
    """The engine's StepTargets (its model's, or its pipeline's loss function's) where the step must
    count targets (data.eod_mask_loss), else None: every target counts and nothing is done."""
    return holder if dims.eod_mask_loss else None


@contextlib.contextmanager
def counting_targets(holder: Optional[StepTargets], batches: list[Batch], ps: ParallelState) -> Iterator[None]:
    """For a step's or an evaluation's micro-batches (on the device), with data.eod_mask_loss: the
    holder weighs each micro-batch loss into the loss per counted target of the global batch
    (model/masking.py's StepTargets). One all-reduce of an int64 device scalar over dp x cp, no
    host read."""
    if holder is None:
        yield
        return
    counted = torch.stack([(batch_targets != IGNORED_TARGET).sum() for _, batch_targets in batches]).sum()
    replicas = ps.grid.size("dp", "cp")
    if replicas > 1:
        dist.all_reduce(counted, group=ps.grad_reduce_group)
    # a global batch without a counted target has no loss: 0/0, whose NaN the step guard skips like any
    # non-finite step (a zero loss would step AdamW's momentum and weight decay on nothing learned)
    holder.factor = (len(batches) * replicas) / counted.to(torch.float64)
    try:
        yield
    finally:
        holder.factor = None


def apply_update(optimizer: torch.optim.Optimizer, lr_scheduler, parameters: Iterable[torch.nn.Parameter], norm: float,
                 clip: float, applied: bool) -> None:
    """The end of a step torch runs itself (the plain and FSDP2 engines, as DeepSpeed's ZeRO-0 does):
    when applied, clip to `clip` by clip / (norm + 1e-6), step the optimizer and the schedule (which
    so advances only on applied steps); either way free the gradients."""
    if applied:
        if clip > 0 and norm > clip:
            torch._foreach_mul_([p.grad for p in parameters if p.grad is not None], clip / (norm + 1e-6))
        optimizer.step()
        lr_scheduler.step()
    # freed, not zeroed: the next backward assigns each gradient instead of adding to a zero one
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def eval_mean(module: torch.nn.Module, batches: list[Batch], device: torch.device, ps: ParallelState,
              step_targets: Optional[StepTargets] = None) -> float:
    """Mean loss of this rank's micro-batches in eval mode, averaged over the data-parallel
    replicas: summed on the device, one host read. step_targets: the engine's (step_targets_of)."""
    module.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    on_it = on_device(batches, device)
    with counting_targets(step_targets, on_it, ps):
        for inputs, targets in on_it:
            total += module(inputs, targets).detach()
    module.train()
    return dp_mean(total / len(batches), ps)


def ensure_adam_state(optimizer: torch.optim.Optimizer, step: int, reset_steps: bool = True) -> None:
    """Every parameter's optimizer state, zeros at `step` before its first step (optim/state.py:
    named by the optimizer, Adam's moments or Muon's momentum); reset_steps: every count to `step`
    (a resume), else the missing ones only (a save)."""
    ensure_state(optimizer, step, reset_steps)


def router_metrics(module: torch.nn.Module, ps: ParallelState, dims: GPTDims, device: torch.device) -> dict[str, float]:
    """MoE router metrics since the last call (every rank calls it: one all-reduce): per MoE layer
    and micro-batch, the aux and z losses added to the loss; the busiest expert's load over the
    mean (max over layers); the share of assignments dropped over capacity. Whether to join is the
    model's (a MoE model), not the stage's: a pipeline stage without MoE layers joins with zeros."""
    if dims.moe is None or dims.num_moe_blocks == 0:
        return {}
    stats = getattr(module, "router_stats", None)
    layers, g = dims.num_moe_blocks, ps.grid
    if stats is None or stats.sums is None:  # no MoE layer ran here: zeros, on the device (a log step)
        sums, counts, forwards = (torch.zeros(4, device=device), torch.zeros(layers, dims.moe.num_experts, device=device),
                                  0)
    else:
        sums, counts, forwards = stats.sums, stats.counts, stats.layer_forwards
    forwards = sums.new_full((1,), float(forwards), dtype=torch.float64)  # a log step: allowed
    packed = torch.cat([sums.double(), forwards, counts.double().flatten()])
    if g.world_size > 1:
        dist.all_reduce(packed)  # pipeline stages too: each filled its own layers' rows
    sums, counts = packed[:5], packed[5:].view(layers, -1)
    # aux/z: each rank added cp x its tokens' part; counts and layer forwards: the same on every
    # tp x cp rank of a micro-batch; so the world's sums count each (micro-batch, layer) tp*cp times
    per_layer_forward = sums[4] / g.tp
    load = counts / counts.mean(1, keepdim=True)
    *values, ran = torch.stack([sums[0] / per_layer_forward, sums[1] / per_layer_forward, load.max(),
                                sums[2] / (sums[3] / (g.tp * g.cp)), sums[4]]).tolist()
    if stats is not None:
        stats.reset()
    if ran == 0:  # no MoE layer ran anywhere since the last call: nothing to report (as before)
        return {}
    return dict(zip(("moe/aux_loss", "moe/z_loss", "moe/max_load", "moe/dropped_fraction"), values))


# ---- what both engines' layout-free checkpoints need ---------------------------------------

def adam_step(optimizer: torch.optim.Optimizer) -> int:
    """Adam's step count (equal on every state entry; 0 before the first step)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def adam_step_tensor(step: int, param: torch.Tensor, in_kernel: bool) -> torch.Tensor:
    """Adam's step count as torch keeps it (optim/state.py)."""
    return step_tensor(step, param, in_kernel)


def jsonable(obj: dict) -> dict:
    """The JSON-representable entries of a state dict (LambdaLR's holds plain numbers and lists)."""
    out = {}
    for key, value in obj.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def restore_schedule(scheduler, last_epoch: int) -> None:
    """Put a LambdaLR at `last_epoch` steps; the lr the next step uses goes into the param groups
    (LambdaLR.load_state_dict would leave them at their initial value)."""
    scheduler.last_epoch = last_epoch
    scheduler._step_count = last_epoch + 1
    lrs = [base * factor(last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    scheduler._last_lr = lrs
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr


def held_model_states(parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, their gradients and optimizer state (each optimizer's tensors by
    name: optim/table.py), by role in DeepSpeed's
    categories (backends/deepspeed/memory.py); a sharded tensor counts its local shard. The engines
    that step with torch's optimizer (FSDP2, plain) keep no reduce buckets, and between steps no
    gradients (each step frees them)."""
    def local_bytes(t: Optional[torch.Tensor]) -> int:
        if t is None:
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    parameters = list(parameters)
    moments = sum(local_bytes(v) for p in parameters for k, v in optimizer.state.get(p, {}).items()
                  if k in ALL_TENSOR_STATE)
    return {"weights": sum(local_bytes(p) for p in parameters), "gradients": sum(local_bytes(p.grad) for p in parameters),
            "optimizer": moments, "buckets": 0, "other": 0}


# ---- the engine's run state beyond weights and optimizer (checkpoint/parts.py) -------------

class RouterBiases:
    """MoE bias balancing's per-expert biases ("router_biases"): whole per layer, the same on every
    rank, so they come back in any layout. state_dict() is a collective over the pipeline stages
    (each holds its own layers' rows), and a host read: at saves only."""

    def __init__(self, module: torch.nn.Module, dims: GPTDims, device: torch.device, pp_group):
        self.module, self.dims, self.device, self.pp_group = module, dims, device, pp_group

    def state_dict(self) -> Optional[dict[str, list[float]]]:
        return router_biases(getattr(self.module, "moe_layers", []), self.dims.num_moe_blocks, self.dims.moe,
                             self.device, self.pp_group) or None

    def load_state_dict(self, state: Optional[dict[str, list[float]]], resume: Resume) -> None:
        load_router_biases(getattr(self.module, "moe_layers", []), state or {})


class DropoutStreams:
    """This rank's TP (and CP) dropout generator ("tp_dropout", in rng_rank{R}.pt): it comes back in
    the layout it was saved in, and restarts from a seed in another."""

    def __init__(self, module: torch.nn.Module, ps: ParallelState):
        self.module, self.tp_rank, self.cp_rank = module, ps.tp_rank, ps.cp_rank

    def state_dict(self) -> dict:
        return self.module.rng.state_dict()

    def load_state_dict(self, state: dict, resume: Resume) -> None:
        self.module.rng.load_state_dict(state)

    def reseed(self, seed: int) -> None:
        self.module.rng.load_state_dict(TPDropoutRNG(seed, self.tp_rank, self.cp_rank).state_dict())


def model_state_parts(module: torch.nn.Module, ps: ParallelState, dims: GPTDims, device: torch.device) -> dict:
    """What a model built by megaframe carries besides its parameters, as checkpoint parts by name."""
    return {"router_biases": RouterBiases(module, dims, device, ps.pp_group), "tp_dropout": DropoutStreams(module, ps)}
