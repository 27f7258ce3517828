"""Between a DeepSpeed engine in any layout and the layout-free checkpoint (checkpoint/universal.py).

Gather (save): every rank takes its parameters' full-over-DP fp32 values and Adam moments (ZeRO 0-3),
TP shards are all-gathered along their partition_dim, the vocabulary padding is cut, pipeline
stages' names are mapped to the canonical (tp=1 GPT) names, and global rank 0 writes the files.
Scatter (load): every rank reads its TP shard of each full tensor (vocabulary zero-padded to this
layout's padded size) and writes it into the module weights, the optimizer's fp32 master partition
and its Adam moments, whatever the ZeRO stage.

Cost: rank 0 holds the whole model and both moments in memory while writing (16 bytes per
parameter in fp32: ~112 GB at 7B) and gather_object pickles it through gloo; fine for the scales
this CPU framework trains, per-stage files would be the next step for large models.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import deepspeed
import torch
import torch.distributed as dist

from megaframe.backends.deepspeed.pipeline import canonical_name
from megaframe.checkpoint import universal
from megaframe.checkpoint.universal import MASTER_KEY, MOMENT_KEYS, CheckpointError
from megaframe.model.dims import GPTDims
from megaframe.model.spec import VOCAB_PARAMS, ModelSpec
from megaframe.parallel.state import ParallelState


@dataclass
class EngineView:
    """What gather/scatter need to know about the running engine and its layout."""

    engine: Any
    ps: ParallelState
    dims: GPTDims
    pipelined: bool
    zero_stage: int
    dtype: str  # fp32 | bf16 | fp16

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer holding Adam state (ZeRO wraps it as .optimizer; ZeRO-0 fp32 does not)."""
        opt = self.engine.optimizer
        return opt.optimizer if isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) else opt


# ---- names ------------------------------------------------------------------------------------

def local_parameters(view: EngineView) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) for this rank's parameters, in module order (same on every
    rank of a TP/DP group, which the collectives below rely on)."""
    layers = ModelSpec(view.dims).layers() if view.pipelined else None
    for name, param in view.engine.module.named_parameters():
        yield (canonical_name(name, layers) if layers else name), param


# ---- reading one parameter's full-over-DP value -----------------------------------------------

def _is_zero3(param) -> bool:
    return hasattr(param, "ds_id")


def _module_value(param) -> torch.Tensor:
    """The weight the model computes with (gathered over DP under ZeRO-3; collective there)."""
    if _is_zero3(param):
        with deepspeed.zero.GatheredParameters([param]):
            return param.data.detach().float().clone()
    return param.data.detach().float().clone()


def _optimizer_value(view: EngineView, param, key: Optional[str]) -> Optional[torch.Tensor]:
    """fp32 master (key None) or an Adam moment over the whole DP group; None when absent.

    DeepSpeed's safe_get_* cover ZeRO 1-3 and the bf16 optimizer (collective over DP: all ranks
    call them for the same parameters in the same order); ZeRO-0 in fp32 is torch's AdamW on the
    module parameters themselves."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _is_zero3(param) or hasattr(param, "_hp_mapping"):
        value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
        return None if value is None else value.detach().float().clone().view(param.ds_shape if _is_zero3(param) else param.shape)
    if key is None:
        return param.data.detach().float().clone()
    state = view.base_optimizer.state.get(param, {})
    return state[key].detach().float().clone() if key in state else None


def _gather_tp(view: EngineView, param, value: torch.Tensor) -> torch.Tensor:
    """The full tensor from every TP rank's piece of `value` (collective over TP)."""
    if not getattr(param, "tensor_model_parallel", False):
        return value
    return param.shard.gather(value, view.ps.tp_group, view.ps.tp)


def _unpad(name: str, value: torch.Tensor, dims: GPTDims) -> torch.Tensor:
    return value[: dims.vocab_size].clone() if name in VOCAB_PARAMS else value


def gather_full_state(view: EngineView, with_optimizer: bool) -> tuple[dict, Optional[dict]]:
    """Global rank 0 gets (model tensors, optimizer tensors) under canonical names; others get ({}, None).

    Every rank must call this (it runs collectives over TP, DP and the world)."""
    keep = view.ps.tp_rank == 0 and view.ps.dp_rank == 0  # one writer per pipeline stage
    if with_optimizer:
        _link_optimizer_state(view)
    model, optim = {}, {}
    fp32 = view.dtype == "fp32"
    for name, param in local_parameters(view):
        if getattr(param, "ds_pipe_replicated", False):
            continue  # the last stage's copy of a tied embedding: the first stage writes it
        values = {"": _module_value(param)}
        if with_optimizer:
            if not fp32:
                values[MASTER_KEY] = _optimizer_value(view, param, None)
            for key in MOMENT_KEYS:
                values[key] = _optimizer_value(view, param, key)
        for key, value in values.items():
            if value is None:
                raise CheckpointError(f"no optimizer {key or 'weights'} for {name}: save after the first step")
            value = _unpad(name, _gather_tp(view, param, value), view.dims)
            if keep:
                (model if key == "" else optim)[name if key == "" else f"{key}.{name}"] = value
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model, (optim if with_optimizer else None)
    pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((model, optim), pieces, dst=0)
    if dist.get_rank() != 0:
        return {}, None
    merged_model, merged_optim = {}, {}
    for part_model, part_optim in pieces:
        merged_model.update(part_model)
        merged_optim.update(part_optim)
    return merged_model, (merged_optim if with_optimizer else None)


def adam_step(view: EngineView) -> int:
    """Adam's step count (equal on every state entry)."""
    for state in view.base_optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


# ---- writing one parameter's slice back -------------------------------------------------------

def _read_shard(handle, key: str, name: str, param, dims: GPTDims) -> torch.Tensor:
    """This TP rank's slice of the stored full tensor `key` (of parameter `name`), in this layout's
    (padded) shape."""
    full_shape = tuple(getattr(param, "partition_shape", None) or getattr(param, "ds_shape", param.shape))
    stored = handle.get_slice(key)
    stored_shape = tuple(stored.get_shape())
    want = (dims.vocab_size, *full_shape[1:]) if name in VOCAB_PARAMS else full_shape
    if stored_shape != want:
        raise CheckpointError(f"{key}: the checkpoint holds shape {list(stored_shape)}, this model needs "
                              f"{list(want)}; the model.* config must match the checkpoint's state.json")
    if not getattr(param, "tensor_model_parallel", False):
        value = stored[:]
        if value.shape[0] != full_shape[0]:  # vocabulary rows: pad to this layout's padded size
            value = torch.cat([value, value.new_zeros(full_shape[0] - value.shape[0], *value.shape[1:])])
        return value
    dim, count, index = param.shard.dim, param.partition_count, param.partition_index
    start, stop = param.shard.bounds(full_shape, index, count)
    size = stop - start
    if dim == 0:
        rows = min(stop, stored_shape[0])
        value = stored[start:rows] if rows > start else torch.zeros(0, *stored_shape[1:])
        if value.shape[0] < size:  # the padded vocabulary rows beyond the real ones
            value = torch.cat([value, value.new_zeros(size - value.shape[0], *value.shape[1:])])
        return value
    return stored[:, start:stop]


def _set_module_value(param, value: torch.Tensor) -> None:
    if _is_zero3(param):  # write this DP rank's flat partition of the (TP-local) tensor
        part = param.ds_tensor
        rank = dist.get_rank(group=param.ds_process_group)
        flat = value.flatten().to(part.dtype)
        padded = torch.cat([flat, flat.new_zeros(part.numel() * (rank + 1) - flat.numel())]) \
            if flat.numel() < part.numel() * (rank + 1) else flat
        part.data.copy_(padded.narrow(0, part.numel() * rank, part.numel()))
    else:
        param.data.copy_(value.to(param.dtype))


def _set_optimizer_value(view: EngineView, param, value: torch.Tensor, key: Optional[str]) -> None:
    """Set the fp32 master (key None) or an Adam moment of `param` from its full-over-DP value."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if _is_zero3(param):
        # ZeRO-3's set_full_hp_param narrows the unpadded tensor and fails when numel % dp != 0;
        # this is its code with the partition padding added
        opt = view.engine.optimizer
        part, _ = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
        rank = opt._get_param_partition_rank(param)
        flat = value.flatten().float()
        need = part.numel() * (rank + 1)
        if flat.numel() < need:
            flat = torch.cat([flat, flat.new_zeros(need - flat.numel())])
        part.data.copy_(flat.narrow(0, part.numel() * rank, part.numel()))
    elif hasattr(param, "_hp_mapping"):
        if key is None:
            safe_set_full_fp32_param(param, value.float())
        else:
            safe_set_full_optimizer_state(param, value.float(), key)
    elif key is not None:  # ZeRO-0 fp32: the module parameter is the master; moments live in torch's state
        view.base_optimizer.state[param][key].copy_(value)


def _create_adam_state(view: EngineView, step: int) -> None:
    """Adam state exists only after the first step (torch and DeepSpeed create it lazily): make it
    now, at the checkpoint's step count, so the moments have somewhere to go."""
    base, opt = view.base_optimizer, view.engine.optimizer
    # the tensors Adam steps: ZeRO's flat fp32 partitions (ZeRO-3 swaps them into param_groups
    # only during its step), else the module parameters
    flats = getattr(opt, "fp32_partitioned_groups_flat", None) or getattr(opt, "single_partition_of_fp32_groups", None)
    for p in flats or [p for group in base.param_groups for p in group["params"]]:
        state = base.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] = torch.tensor(float(step))
    _link_optimizer_state(view)


def _link_optimizer_state(view: EngineView) -> None:
    """ZeRO 1/2: point every parameter's hp mapping at its Adam state. DeepSpeed links them once,
    right after the FIRST param group's first step, so later groups' parameters (our no-decay
    group) never see theirs; relinking every group is idempotent."""
    link = getattr(view.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        view.engine.optimizer._hp_optimizer_states_linked = False
        link()


@torch.no_grad()
def scatter_full_state(view: EngineView, directory: Path, optim_step: Optional[int]) -> None:
    """Load every local parameter (weights, fp32 master, Adam moments when present) from a
    universal checkpoint. optim_step None = model only: masters follow the weights, Adam starts fresh."""
    directory = Path(directory)
    with_optimizer = optim_step is not None and (directory / universal.OPTIMIZER_FILE).is_file()
    if with_optimizer:
        _create_adam_state(view, optim_step)
    with contextlib.ExitStack() as files:
        model_file = files.enter_context(universal.open_tensors(directory, universal.MODEL_FILE))
        optim_file = files.enter_context(universal.open_tensors(directory, universal.OPTIMIZER_FILE)) \
            if with_optimizer else None
        stored = set(model_file.keys()) | (set(optim_file.keys()) if optim_file is not None else set())
        for name, param in local_parameters(view):
            wanted = [name] + ([f"{key}.{name}" for key in MOMENT_KEYS] if with_optimizer else [])
            if missing := [k for k in wanted if k not in stored]:
                raise CheckpointError(f"checkpoint {directory} has no tensor {missing[0]}; the model.* config "
                                      f"must match the checkpoint's state.json")
            weight = _read_shard(model_file, name, name, param, view.dims)
            _set_module_value(param, weight)
            master = weight
            if with_optimizer and f"{MASTER_KEY}.{name}" in stored:
                master = _read_shard(optim_file, f"{MASTER_KEY}.{name}", name, param, view.dims)
            _set_optimizer_value(view, param, master, None)
            for key in MOMENT_KEYS if with_optimizer else ():
                _set_optimizer_value(view, param, _read_shard(optim_file, f"{key}.{name}", name, param, view.dims), key)


# ---- what the trainer calls -------------------------------------------------------------------

def layout_record(view: EngineView) -> dict[str, Any]:
    """The layout a checkpoint was written in: DeepSpeed's own files load only into the same one."""
    return {"tp": view.ps.tp, "pp": view.ps.pp, "dp": view.ps.dp, "zero_stage": view.zero_stage, "dtype": view.dtype}


def _jsonable(obj: dict) -> dict:
    """The JSON-representable entries of a state dict (LambdaLR's holds plain numbers and lists)."""
    out = {}
    for key, value in obj.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def save_universal(view: EngineView, directory: Path, state: dict[str, Any], lr_scheduler,
                   tokenizer_dir: Optional[Path] = None, defer: bool = False) -> Optional[Callable[[], None]]:
    """Write model/optimizer/state.json into `directory` (rank 0; every rank must call: collectives).

    `state` holds step, consumed_samples, model and whatever else the run wants in state.json.
    defer: gather now, write later: rank 0 gets back a function that writes a snapshot (copies of
    the tensors, so training may go on changing the live ones); the other ranks get None."""
    model, optim = gather_full_state(view, with_optimizer=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    full_state = {**state, "optim_step": adam_step(view), "layout": layout_record(view),
                  "lr_scheduler": _jsonable(lr_scheduler.state_dict())}
    if scaler := loss_scaler_state(view.engine.optimizer):
        full_state["loss_scaler"] = scaler
    if not defer:
        universal.write_files(directory, model, full_state, optim, tokenizer_dir)
        return None
    # gather_full_state's tensors are copies (_module_value and _optimizer_value clone): a snapshot
    # training does not touch; the async test (slow_save) holds the files to the synchronous ones
    return lambda: universal.write_files(directory, model, full_state, optim, tokenizer_dir)


# DeepSpeed's dynamic fp16 loss scaler: the scale, and the counters that decide when it next grows
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_state(optimizer) -> dict[str, float]:
    """The fp16 loss scaler's state (empty without one), so a resume grows the scale when the
    uninterrupted run would have."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None or not getattr(scaler, "dynamic", False):
        scale = getattr(optimizer, "cur_scale", None)
        return {"cur_scale": float(scale)} if isinstance(scale, (int, float, torch.Tensor)) else {}
    return {field: float(getattr(scaler, field)) for field in _SCALER_FIELDS if hasattr(scaler, field)}


def restore_loss_scaler(optimizer, state: dict[str, float]) -> None:
    """Put loss_scaler_state() back (a checkpoint without the counters restores the scale alone)."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and getattr(scaler, "dynamic", False):
        for field in _SCALER_FIELDS:
            if field in state:
                setattr(scaler, field, type(getattr(scaler, field))(state[field]))
    elif "cur_scale" in state and hasattr(optimizer, "cur_scale"):
        optimizer.cur_scale = state["cur_scale"]


def _restore_schedule(scheduler, last_epoch: int) -> None:
    """Put a LambdaLR at `last_epoch` steps; the lr the next step uses goes into the param groups
    (LambdaLR.load_state_dict would leave them at their initial value)."""
    scheduler.last_epoch = last_epoch
    scheduler._step_count = last_epoch + 1
    lrs = [base * factor(last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    scheduler._last_lr = lrs
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr


def resume_universal(view: EngineView, directory: Path, lr_scheduler) -> dict[str, Any]:
    """Load a universal checkpoint into the running engine; return its state.json.

    The schedule comes from this run's config, its position from the checkpoint. A model-only
    checkpoint (no optimizer.safetensors) starts Adam fresh from its weights."""
    state = universal.read_state(directory)
    has_optimizer = (Path(directory) / universal.OPTIMIZER_FILE).is_file()
    scatter_full_state(view, directory, int(state.get("optim_step", state["step"])) if has_optimizer else None)
    step = int(state["step"])
    _restore_schedule(lr_scheduler, int(state.get("lr_scheduler", {}).get("last_epoch", step)))
    restore_loss_scaler(view.engine.optimizer, state.get("loss_scaler", {}))
    view.engine.global_steps = step
    view.engine.global_samples = int(state["consumed_samples"])
    return state
