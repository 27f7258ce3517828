"""Between an FSDP2 model in any layout and the layout-free checkpoint (checkpoint/), the format
DeepSpeed's backend writes too: one format for both engines, so a run moves between them. The
optimizer's state is stored by the names its optimizer gives it (optim/table.py).

A rank's part of a parameter is a rectangle of the full tensor: its TP shard (placed by the
parameter's ShardSpec marks) cut along dim 0 by FSDP into this rank's local shard (placed by the
DTensor's placements). Each rank writes the weight, fp32 master (bf16 runs) and Adam moments of its
local shard as one box, and reads back exactly its box; nothing is gathered, no collective runs.
Replicas write nothing: ranks other than TP rank 0 for parameters TP does not split, and under
HSDP every shard group but the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megaframe.backends import common
from megaframe.backends.common import adam_step, ensure_adam_state, jsonable, restore_schedule
from megaframe.backends.fsdp2.build import compute_dtype, local_box
from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint.boxes import Box, clip_rows
from megaframe.checkpoint.staging import HostStaging
from megaframe.checkpoint.universal import MASTER_KEY
from megaframe.config.schema import TrainConfig
from megaframe.model.dims import GPTDims
from megaframe.model.spec import VOCAB_PARAMS
from megaframe.optim.state import optimizer_name, same_optimizer, state_keys_by_param
from megaframe.parallel.state import ParallelState


@dataclass
class ShardView:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    ps: ParallelState
    dims: GPTDims
    cfg: TrainConfig
    replica: int = 0  # HSDP: which replica of the shard group this rank is in (replica 0 writes)
    copies: frozenset = frozenset()  # ids of parameters another stage writes (a tied embedding's copy)


@dataclass
class LocalPart:
    """Parameter `name`'s local shard: its box in the full (unpadded) tensor, and whether this rank
    is the one that writes it."""

    name: str
    param: torch.nn.Parameter
    full_shape: tuple[int, ...]
    box: Optional[Box]  # None: nothing of the stored tensor here (vocabulary padding rows only, or empty)
    writes: bool

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's local tensor (of the parameter or a moment) that the box covers."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local[: self.box.shape[0]] if self.box is not None else local[:0]


def _part(name: str, param: torch.nn.Parameter, ps: ParallelState, dims: GPTDims, replica: int,
          copy: bool = False) -> LocalPart:
    local_shape, fsdp_offset = local_box(param)
    padded = tuple(getattr(param, "partition_shape", None) or param.shape)
    tp_offset = [0] * len(padded)
    shard = getattr(param, "shard", None)
    if shard is not None and getattr(param, "partition_count", 1) > 1:
        tp_offset[shard.dim] = shard.bounds(padded, param.partition_index, param.partition_count)[0]
    full_shape = (dims.vocab_size, *padded[1:]) if name in VOCAB_PARAMS else padded
    box: Optional[Box] = Box(tuple(a + b for a, b in zip(tp_offset, fsdp_offset)), tuple(local_shape))
    if name in VOCAB_PARAMS:
        box = clip_rows(box, full_shape[0])  # padding rows are zeros, never stored
    if box is not None and box.numel == 0:
        box = None
    tp_sharded = shard is not None and shard.axis == "tp" and getattr(param, "partition_count", 1) > 1
    # experts shard over their own expert-data-parallel ranks: no HSDP replica among those
    first_replica = replica == 0 or (shard is not None and shard.axis == "ep" and getattr(param, "partition_count", 1) > 1)
    return LocalPart(name, param, full_shape, box, (tp_sharded or ps.tp_rank == 0) and first_replica and not copy)


def local_parts(view: ShardView) -> list[LocalPart]:
    return [_part(name, p, view.ps, view.dims, view.replica, id(p) in view.copies)
            for name, p in view.module.named_parameters()]


def _stored(view: ShardView, part: LocalPart, keys: tuple[str, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """The stored tensors of one part, by checkpoint key: how to read each from the live state."""
    state = view.optimizer.state.get(part.param, {})
    # each in its own dtype (an async save's host copy is as small as it can be); the writer widens it to fp32
    out = {part.name: lambda: part.local(part.param).detach().to(compute_dtype(view.cfg.precision.dtype))}
    if view.cfg.precision.dtype != "fp32":  # the sharded fp32 parameter is the master
        out[f"{MASTER_KEY}.{part.name}"] = lambda: part.local(part.param).detach()
    for key in keys:
        out[f"{key}.{part.name}"] = lambda key=key: part.local(state[key]).detach()
    return out


def layout_record(ps: ParallelState, cfg: TrainConfig) -> dict[str, Any]:
    """The layout this rank's RNG states belong to (restored on a resume into the same one)."""
    return {"engine": "fsdp2", **ps.grid.layout_record(), "zero_stage": cfg.zero.stage, "dtype": cfg.precision.dtype}


def save(view: ShardView, directory: Path, state: dict[str, Any], tokenizer_dir: Optional[Path],
         staging: Optional[HostStaging]) -> Union[dict, Callable[[], dict]]:
    """Write this rank's shard (every rank; no collective) and, on global rank 0, state.json. staging
    (a background save): copy the chunks into its host buffers now and return the function that
    writes them later."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    # read once, before any copy is queued: a read of a device step count after them would wait for them all
    optim_step = adam_step(view.optimizer)
    ensure_adam_state(view.optimizer, optim_step, reset_steps=False)
    pieces, keys = [], state_keys_by_param(view.optimizer)
    snapshot = staging.start() if staging is not None else None
    for part in local_parts(view):
        if not part.writes or part.box is None:
            continue
        for key, read in _stored(view, part, keys[id(part.param)]).items():
            if snapshot is not None:
                read = lambda v=snapshot.copy(read()): v  # noqa: E731  (the values as they are now)
            pieces.append(sharded.Piece(key, part.full_shape, part.box, read))
    full_state = None
    if rank == 0:
        full_state = {**state, "version": universal.SHARDED_VERSION, "optim_step": optim_step,
                      "layout": layout_record(view.ps, view.cfg),
                      "lr_scheduler": jsonable(view.lr_scheduler.state_dict())}

    write = sharded.rank_writer(directory, rank, pieces, full_state, tokenizer_dir)
    return sharded.write_or_defer(write, snapshot)


def _read_box(reader: sharded.ShardReader, part: LocalPart, key: str) -> torch.Tensor:
    sharded.check_stored(reader, key, part.full_shape)
    return reader.read(key, part.box)


@torch.no_grad()
def load_shards(view: ShardView, directory: Path, optim_step: Optional[int]) -> None:
    """Every local shard's weight (the fp32 master where stored) and optimizer state from a layout-free
    checkpoint written by either engine in any layout. optim_step None, or a checkpoint without
    optimizer tensors: weights only, the optimizer starts fresh."""
    with sharded.ShardReader(directory) as reader:
        with_optimizer = optim_step is not None and any(universal.is_optimizer_key(k) for k in reader.keys())
        keys = state_keys_by_param(view.optimizer)
        if with_optimizer:
            ensure_adam_state(view.optimizer, optim_step)
        for part in local_parts(view):
            if part.box is None:
                continue
            master = f"{MASTER_KEY}.{part.name}"
            source = master if with_optimizer and master in reader else part.name
            part.local(part.param).copy_(_read_box(reader, part, source))
            if with_optimizer:
                state = view.optimizer.state[part.param]
                for key in keys[id(part.param)]:
                    part.local(state[key]).copy_(_read_box(reader, part, f"{key}.{part.name}"))
            reader.release()


def resume(view: ShardView, directory: Path) -> dict[str, Any]:
    """Load a layout-free checkpoint into the running model; return its state.json."""
    state = universal.read_state(directory)
    # another optimizer's state (a switch train.resume_accept_optimizer_change accepted): weights only
    own = same_optimizer(state, optimizer_name(view.optimizer))
    load_shards(view, directory, int(state.get("optim_step", state["step"])) if own else None)
    step = int(state["step"])
    restore_schedule(view.lr_scheduler, int(state.get("lr_scheduler", {}).get("last_epoch", step)))
    return state


def held_model_states(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's local shards by role (backends/common.py). The gathered blocks of a
    forward or backward are transient (the planner counts them apart); in the backward each sharded
    gradient is its parameter's shape and dtype (fp32), so as many bytes as the weights."""
    held = common.held_model_states(module.parameters(), optimizer)
    return {**held, "gradients_in_backward": held["weights"]}
