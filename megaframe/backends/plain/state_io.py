"""Between the one-process model and the layout-free checkpoint (checkpoint/), the format both
engines write: each parameter whole (the vocabulary's padding rows left out), with its optimizer state by name,
so a one-process run resumes any engine's checkpoint of any layout and any layout resumes its."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from megaframe.backends.common import adam_step, ensure_adam_state, jsonable, restore_schedule
from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint.boxes import Box, clip_rows
from megaframe.checkpoint.staging import HostStaging
from megaframe.model.dims import GPTDims
from megaframe.model.spec import VOCAB_PARAMS
from megaframe.optim.state import optimizer_name, same_optimizer, state_keys_by_param


@dataclass
class PlainView:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    dims: GPTDims
    layout: dict[str, Any]  # the engine's layout record (RNG states come back only into the same one)


def _stored_box(name: str, param: torch.nn.Parameter, dims: GPTDims) -> tuple[tuple[int, ...], Box]:
    """(full shape, box) of a parameter as stored: whole, but for the vocabulary's padding rows."""
    shape = tuple(param.shape)
    box = Box((0,) * len(shape), shape)
    if name in VOCAB_PARAMS:
        return (dims.vocab_size, *shape[1:]), clip_rows(box, dims.vocab_size)
    return shape, box


def save(view: PlainView, directory: Path, state: dict[str, Any], tokenizer_dir: Optional[Path],
         staging: Optional[HostStaging]) -> Union[dict, Callable[[], dict]]:
    """Write the one shard and state.json. staging (a background save): copy the tensors into its
    host buffers now and return the function that writes them later."""
    # read once, before any copy is queued: a read of a device step count after them would wait for them all
    optim_step = adam_step(view.optimizer)
    ensure_adam_state(view.optimizer, optim_step, reset_steps=False)
    pieces, keys = [], state_keys_by_param(view.optimizer)
    snapshot = staging.start() if staging is not None else None
    for name, param in view.module.named_parameters():
        full_shape, box = _stored_box(name, param, view.dims)
        moments = view.optimizer.state[param]
        for key, tensor in ((name, param), *((f"{k}.{name}", moments[k]) for k in keys[id(param)])):
            def read(t=tensor, rows=box.shape[0]) -> torch.Tensor:
                return t.detach()[:rows]  # in its own dtype: the writer widens it to fp32
            if snapshot is not None:
                read = lambda c=snapshot.copy(read()): c  # noqa: E731  (the values as they are now)
            pieces.append(sharded.Piece(key, full_shape, box, read))
    full_state = {**state, "version": universal.SHARDED_VERSION, "optim_step": optim_step,
                  "layout": view.layout, "lr_scheduler": jsonable(view.lr_scheduler.state_dict())}
    write = sharded.rank_writer(directory, 0, pieces, full_state, tokenizer_dir)
    return sharded.write_or_defer(write, snapshot)


@torch.no_grad()
def resume(view: PlainView, directory: Path) -> dict[str, Any]:
    """Load a layout-free checkpoint written by either engine in any layout; return its state.json.
    A checkpoint without optimizer tensors (the HF converter's), or another optimizer's (a switch
    train.resume_accept_optimizer_change accepted), starts the optimizer fresh from its weights;
    fp32 masters (a bf16 run's) are read in place of the rounded weights."""
    state = universal.read_state(directory)
    optim_step = int(state.get("optim_step", state["step"]))
    with sharded.ShardReader(directory) as reader:
        with_optimizer = any(universal.is_optimizer_key(k) for k in reader.keys())
        own_state = with_optimizer and same_optimizer(state, optimizer_name(view.optimizer))
        keys = state_keys_by_param(view.optimizer)
        if own_state:
            ensure_adam_state(view.optimizer, optim_step)
        for name, param in view.module.named_parameters():
            full_shape, box = _stored_box(name, param, view.dims)
            master = f"{universal.MASTER_KEY}.{name}"
            source = master if with_optimizer and master in reader else name
            sharded.check_stored(reader, source, full_shape)
            param[: box.shape[0]].copy_(reader.read(source, box))
            if own_state:
                moments = view.optimizer.state[param]
                for key in keys[id(param)]:
                    sharded.check_stored(reader, f"{key}.{name}", full_shape)
                    moments[key][: box.shape[0]].copy_(reader.read(f"{key}.{name}", box))
            reader.release()
    restore_schedule(view.lr_scheduler, int(state.get("lr_scheduler", {}).get("last_epoch", state["step"])))
    return state

