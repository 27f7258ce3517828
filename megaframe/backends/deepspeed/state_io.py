"""Between a DeepSpeed engine in any layout and the layout-free checkpoint (checkpoint/).

Every rank writes only what it owns and reads only what it needs; no collective moves state, but
one at a ZeRO-1/2 resume: the all-gather that rebuilds the weights from the masters' ranges, as each
ZeRO-1/2 step ends (a rank that failed to read exits, and the launcher ends the others waiting in it).
- What a rank owns of a parameter (a Holding): its tensor-parallel shard of the full tensor (where
  the shard sits comes from the parameter's ShardSpec), and of that shard the flat range whose
  optimizer state it holds: ZeRO-3's partition, the ZeRO-1/2 (and bf16 optimizer) fragment, or at
  ZeRO-0 fp32, where every DP rank holds everything, an even 1/dp split so the writing is shared.
  Replicas write nothing: TP ranks other than 0 for unsharded parameters, the last pipeline
  stage's copy of a tied embedding.
- Save: the owned range of the weights, fp32 master and optimizer state (each parameter's by the
  names its optimizer gives it: Adam's moments, Muon's momentum; optim/table.py), cut into boxes of the full
  tensor (vocabulary padding dropped), goes to the rank's file one chunk at a time
  (checkpoint/sharded.py); an async save first copies those chunks to host memory, its own shard.
- Load: the same boxes for this layout, read from whichever chunks overlap them (memory-mapped
  slices), written into the module weights (the whole TP shard, except under ZeRO-3 its partition),
  the master and the moments (the owned range).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from megaframe.backends.deepspeed.pipeline import canonical_name
from megaframe.backends.deepspeed.zero_init import partition_range
from megaframe.backends.common import adam_step, adam_step_tensor, jsonable, restore_schedule
from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint.boxes import Box, clip_rows, even_range, flat_range_boxes
from megaframe.checkpoint.staging import HostStaging, Snapshot
from megaframe.checkpoint.universal import MASTER_KEY, MOMENT_KEYS, CheckpointError
from megaframe.optim.table import COUNTS_STEPS, group_optimizer, state_keys
from megaframe.model.dims import GPTDims
from megaframe.model.spec import VOCAB_PARAMS, ModelSpec
from megaframe.parallel.state import ParallelState
from megaframe.optim.state import same_optimizer

WEIGHT = ""  # the key of the module weights among a parameter's stored tensors


@dataclass
class EngineView:
    """What saving and loading need to know about the running engine and its layout."""

    engine: Any
    ps: ParallelState
    dims: GPTDims
    pipelined: bool
    zero_stage: int
    dtype: str  # fp32 | bf16 | fp16
    optimizer: str = "adamw"  # the optimizer's name a checkpoint records (optim/state.py)
    # id(module parameter) -> its state tensors' names, where not Adam's moments (optim/state.py's
    # state_keys_by_param of megaframe's optimizer, taken before DeepSpeed put flat partitions in its groups)
    keys_by_param: Optional[dict] = None

    def moment_keys(self, param) -> tuple[str, ...]:
        """The optimizer state tensors stored for `param` (AdamW's moments unless said otherwise)."""
        return (self.keys_by_param or {}).get(id(param), MOMENT_KEYS)

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer holding Adam state (ZeRO wraps it as .optimizer; ZeRO-0 fp32 does not)."""
        opt = self.engine.optimizer
        return opt.optimizer if isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) else opt


# ---- names ------------------------------------------------------------------------------------

def local_parameters(view: EngineView) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) for this rank's parameters, in module order."""
    layers = ModelSpec(view.dims).layers() if view.pipelined else None
    for name, param in view.engine.module.named_parameters():
        yield (canonical_name(name, layers) if layers else name), param


# ---- what a rank owns of one parameter ---------------------------------------------------------

def _is_zero3(param) -> bool:
    return hasattr(param, "ds_id")


@dataclass
class Holding:
    """This rank's part of parameter `name`: its TP shard (local_shape, placed at local_offset in the
    padded full tensor) and the flat range `own` of that shard whose optimizer state it holds."""

    name: str
    param: torch.nn.Parameter
    full_shape: tuple[int, ...]  # the stored (unpadded) shape
    local_shape: tuple[int, ...]
    local_offset: tuple[int, ...]
    own: tuple[int, int]
    writes: bool  # False for a replica another rank writes
    kind: str  # zero3 | fragment (ZeRO-1/2, bf16 optimizer) | plain (ZeRO-0 fp32: torch's optimizer)

    @property
    def numel(self) -> int:
        return prod(self.local_shape)

    def boxes(self, start: int, stop: int) -> list[tuple[int, Box]]:
        """(position in the flat range, box of the full tensor) for elements [start, stop) of the
        shard; vocabulary padding rows are left out (they are zeros, never stored)."""
        out, position = [], 0
        for local in flat_range_boxes(self.local_shape, start, stop):
            box = local.shifted(self.local_offset)
            if self.name in VOCAB_PARAMS:
                box = clip_rows(box, self.full_shape[0])
            if box is not None:
                out.append((position, box))
            position += local.numel
        return out


def _holding(view: EngineView, name: str, param) -> Holding:
    local_shape = tuple(param.ds_shape) if _is_zero3(param) else tuple(param.shape)
    padded = tuple(getattr(param, "partition_shape", None) or local_shape)
    offset = [0] * len(local_shape)
    if getattr(param, "partition_count", 1) > 1:
        offset[param.shard.dim] = param.shard.bounds(padded, param.partition_index, param.partition_count)[0]
    full_shape = (view.dims.vocab_size, *padded[1:]) if name in VOCAB_PARAMS else padded
    numel = prod(local_shape)
    if _is_zero3(param):
        kind = "zero3"
        own = partition_range(param, numel)
    elif hasattr(param, "_hp_mapping"):
        kind = "fragment"
        mapping = param._hp_mapping
        own = (mapping.lp_fragment_address.start, mapping.lp_fragment_address.start
               + mapping.lp_fragment_address.numel) if mapping is not None else (0, 0)
    else:
        kind = "plain"
        # the replicas of the parameter split its state evenly, as DeepSpeed's ZeRO does: the dp x cp
        # ranks, or for experts split over ep ranks their expert-data-parallel (edp) ranks
        if getattr(param, "shard", None) is not None and param.shard.axis == "ep" and view.ps.grid.ep > 1:
            own = even_range(numel, view.ps.coords.edp, view.ps.grid.edp)
        else:
            own = even_range(numel, view.ps.dp_rank * view.ps.cp + view.ps.cp_rank, view.ps.dp * view.ps.cp)
    # TP shards write from every TP rank; anything else (experts too: not TP-split) from TP rank 0
    tp_sharded = getattr(param, "partition_count", 1) > 1 and param.shard.axis == "tp"
    writes = not getattr(param, "ds_pipe_replicated", False) and (tp_sharded or view.ps.tp_rank == 0)
    return Holding(name, param, full_shape, local_shape, tuple(offset), own, writes, kind)


def holdings(view: EngineView) -> list[Holding]:
    return [_holding(view, name, param) for name, param in local_parameters(view)]


def _zero3_local(param, key: str) -> Optional[torch.Tensor]:
    """ZeRO-3: this rank's flat fp32 partition of the master or an optimizer state; None before the
    first step. Read in place, where the sub-group lives (device, or host memory under offload=cpu):
    DeepSpeed's local API synchronises its reduce stream on every call (the default stream unless
    zero.overlap_comm), so the step loop waited there for every copy an async save had already
    queued, and it copied an offloaded partition to the device first. Through that API only where
    NVMe holds the sub-group: it swaps the sub-group in and releases its buffers (use the result at once)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    if not param.requires_grad:  # no partition of its own (as DeepSpeed's API answers)
        return None
    optimizer = param._z3_optimizer
    position = optimizer.grad_position.get(optimizer.get_param_id(param))  # None: not in the optimizer's groups
    group, offset, numel = position if position is not None else (None, 0, 0)
    if position is not None and not optimizer._swappable_optimizer_subgroup(group):
        flat = optimizer.fp32_partitioned_groups_flat[group]
        state = optimizer.optimizer.state.get(flat, {})
        if key != MASTER_KEY and key not in state:
            return None
        return (flat if key == MASTER_KEY else state[key]).narrow(0, offset, numel)
    try:
        return safe_get_local_fp32_param(param) if key == MASTER_KEY else safe_get_local_optimizer_state(param, key)
    except KeyError:
        return None


def _set_zero3_local(param, key: str, values: torch.Tensor) -> None:
    """Set the ZeRO-3 partition of the master or a moment from the owned range's values (the padding
    past the parameter's end stays zero); swaps an NVMe sub-group back out."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    padded = values.new_zeros(param.ds_tensor.ds_numel)
    padded[: values.numel()] = values
    if key == MASTER_KEY:
        safe_set_local_fp32_param(param, padded)
    else:
        safe_set_local_optimizer_state(param, padded, key)


def _owned(view: EngineView, h: Holding, key: str) -> Optional[torch.Tensor]:
    """The flat tensor of `key` (WEIGHT, master, a moment) over h.own, live (a view where the engine
    keeps one); None when the optimizer has no such state yet."""
    start, stop = h.own
    if key == WEIGHT and h.kind == "zero3":
        # the module's partition is the master rounded to the module dtype (DeepSpeed copies it after
        # every step); read through the master, which DeepSpeed swaps in when NVMe holds it
        master = _zero3_local(h.param, MASTER_KEY)
        return master.flatten()[: stop - start].to(h.param.dtype)  # the writer widens it to fp32
    if key == WEIGHT:
        return h.param.data.flatten()[start:stop]
    if h.kind == "zero3":
        part = _zero3_local(h.param, key)
        return None if part is None else part.flatten()[: stop - start]
    if h.kind == "fragment":
        mapping = h.param._hp_mapping
        if mapping is None:
            return h.param.data.new_zeros(0, dtype=torch.float32)
        try:
            return mapping.get_hp_fragment(None if key == MASTER_KEY else key).flatten()
        except (ValueError, TypeError, KeyError):  # no optimizer state before the first step
            return None
    if key == MASTER_KEY:  # ZeRO-0 fp32: the module weight is the master
        return h.param.data.flatten()[start:stop]
    state = view.base_optimizer.state.get(h.param, {})
    return state[key].flatten()[start:stop] if key in state else None


def _stored_keys(view: EngineView, with_optimizer: bool, param: Optional[torch.nn.Parameter] = None
                 ) -> tuple[str, ...]:
    """The tensors of a parameter a checkpoint stores (fp32 runs have no separate master); its
    optimizer's state names (param None: AdamW's)."""
    if not with_optimizer:
        return (WEIGHT,)
    return (WEIGHT, *(() if view.dtype == "fp32" else (MASTER_KEY,)), *view.moment_keys(param))


def _tensor_key(key: str, name: str) -> str:
    return name if key == WEIGHT else f"{key}.{name}"


def shard_pieces(view: EngineView, with_optimizer: bool, snapshot: Optional[Snapshot] = None) -> list[sharded.Piece]:
    """The chunks this rank writes. snapshot: their values copied into its host buffers now (an async
    save: training may change the live tensors while the writer runs); else each is read when the
    writer reaches it (a view of the live state, or one parameter's copy)."""
    if with_optimizer:
        if not any(view.base_optimizer.state.values()):
            # no step applied yet (the first ones skipped: non-finite, or fp16's scale search): the
            # moments are zeros, which is what Adam's first applied step would start from
            _create_adam_state(view, adam_step(view.base_optimizer))
        _link_optimizer_state(view)

    # the last (parameter, key) read: its up to three boxes are written one after another, so the
    # engine is asked once per key (one ZeRO-3 local read, one NVMe swap-in), and one tensor is held
    latest: dict = {}

    def owned(h: Holding, key: str) -> torch.Tensor:
        if latest.get("of") != (h.name, key):
            flat = _owned(view, h, key)
            if flat is None:
                raise CheckpointError(f"no optimizer {key} for {h.name}: save after the first step")
            latest.update(of=(h.name, key), flat=flat)
        return latest["flat"]

    pieces = []
    for h in holdings(view):
        if not h.writes or h.own[0] == h.own[1]:
            continue
        for key in _stored_keys(view, with_optimizer, h.param):
            copy = snapshot.copy(owned(h, key)) if snapshot is not None else None
            for position, box in h.boxes(*h.own):
                def values(h=h, key=key, copy=copy, at=position, n=box.numel) -> torch.Tensor:
                    return (copy if copy is not None else owned(h, key))[at: at + n]
                pieces.append(sharded.Piece(_tensor_key(key, h.name), h.full_shape, box, values))
    return pieces


def _stepped_tensors(view: EngineView) -> list[tuple[torch.Tensor, dict]]:
    """(tensor, its param group) for every tensor the optimizer steps: ZeRO's flat fp32 partitions
    (ZeRO-3 swaps them into param_groups only during its step, one sub-group at a time), else the
    module parameters."""
    base, opt = view.base_optimizer, view.engine.optimizer
    if getattr(opt, "fp32_partitioned_groups_flat", None):
        return [(flat, base.param_groups[opt.sub_group_to_group_id[sub]])
                for sub, flat in enumerate(opt.fp32_partitioned_groups_flat)]
    if getattr(opt, "single_partition_of_fp32_groups", None):
        return list(zip(opt.single_partition_of_fp32_groups, base.param_groups))
    return [(p, group) for group in base.param_groups for p in group["params"]]


def _create_adam_state(view: EngineView, step: int) -> None:
    """Optimizer state exists only after the first step (torch and DeepSpeed create it lazily): make
    it now (each group's tensors by its optimizer's names: Adam's moments at the checkpoint's step
    count, Muon's momentum), so the stored tensors have somewhere to go."""
    base = view.base_optimizer
    for p, group in _stepped_tensors(view):
        state = base.state[p]
        for key in state_keys(group):
            if key not in state:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if COUNTS_STEPS[group_optimizer(group)]:
            in_group = any(q is p for q in group["params"])  # ZeRO-3's flats are not, outside its step
            in_kernel = bool(group.get("fused") or group.get("capturable")) if in_group else _fused(base)
            state["step"] = adam_step_tensor(step, p, in_kernel)
    _link_optimizer_state(view)


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)


def _link_optimizer_state(view: EngineView) -> None:
    """ZeRO 1/2: point every parameter's hp mapping at its Adam state. DeepSpeed links them once,
    right after the FIRST param group's first step, so later groups' parameters (our no-decay
    group) never see theirs; relinking every group is idempotent."""
    link = getattr(view.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        view.engine.optimizer._hp_optimizer_states_linked = False
        link()



def _read_range(reader: sharded.ShardReader, h: Holding, key: str, start: int, stop: int) -> torch.Tensor:
    """Flat fp32 values of elements [start, stop) of this rank's shard of stored tensor `key`."""
    sharded.check_stored(reader, key, h.full_shape)
    out = torch.zeros(stop - start, dtype=torch.float32)
    for position, box in h.boxes(start, stop):
        out[position: position + box.numel] = reader.read(key, box).flatten()
    return out


def _load_holding(view: EngineView, reader: sharded.ShardReader, h: Holding, with_optimizer: bool) -> None:
    """Write one parameter's stored values into the engine: module weight, master, moments."""
    start, stop = h.own
    name = h.name
    if h.kind == "zero3":
        weight = _read_range(reader, h, name, start, stop)
        partition = h.param.ds_tensor
        if partition.numel() != partition.ds_numel:
            raise CheckpointError(f"{name}: its ZeRO-3 partition is on NVMe (offload.param=nvme), which loading a "
                                  f"layout-free checkpoint does not support yet; resume with offload.param=cpu")
        partition.data.flatten()[: stop - start].copy_(weight)
    elif h.kind == "fragment":
        # ZeRO-1/2: the rank's own range only. The module's weights are every rank's masters rounded
        # (what DeepSpeed's step leaves them), rebuilt by load_shards' all-gather once every range is in:
        # each replica reading its whole TP shard read the weights dp times (4.4 TB at 70B on 512 ranks)
        weight = None
    else:  # ZeRO-0: every DP rank holds the whole TP shard and its moments
        weight = _read_range(reader, h, name, 0, h.numel)
        h.param.data.copy_(weight.view(h.local_shape))
        weight = weight[start:stop]
    if h.kind == "plain":  # ZeRO-0 fp32: the weight is the master; moments are whole on every DP rank
        for key in view.moment_keys(h.param) if with_optimizer else ():
            view.base_optimizer.state[h.param][key].copy_(_read_range(reader, h, f"{key}.{name}", 0, h.numel)
                                                          .view(h.local_shape))
        return
    master_key = f"{MASTER_KEY}.{name}"
    if with_optimizer and master_key in reader:
        master = _read_range(reader, h, master_key, start, stop)
    else:  # fp32 (the weight is the master), or model only (the masters follow the weights)
        master = weight if weight is not None else _read_range(reader, h, name, start, stop)
    targets = {None: master}
    for key in view.moment_keys(h.param) if with_optimizer else ():
        targets[key] = _read_range(reader, h, f"{key}.{name}", start, stop)
    for key, values in targets.items():
        if h.kind == "zero3":
            _set_zero3_local(h.param, MASTER_KEY if key is None else key, values)
        elif h.param._hp_mapping is not None:
            h.param._hp_mapping.get_hp_fragment(key).flatten().copy_(values)


@torch.no_grad()
def load_shards(view: EngineView, directory: Path, optim_step: Optional[int]) -> None:
    """Load every local parameter (weights, fp32 master, Adam moments when present) from a
    layout-free checkpoint of either version. optim_step None = model only: masters follow the
    weights, Adam starts fresh."""
    with sharded.ShardReader(directory) as reader:
        with_optimizer = optim_step is not None and any(universal.is_optimizer_key(k) for k in reader.keys())
        if with_optimizer:
            _create_adam_state(view, optim_step)
        held = holdings(view)
        for h in held:
            _load_holding(view, reader, h, with_optimizer)
            reader.release()
    if any(h.kind == "fragment" for h in held):
        # ZeRO-1/2 read their masters' ranges only: the weights are the masters rounded, gathered over the
        # dp ranks (collective: every rank of the engine calls it; DeepSpeed's own step ends the same way)
        view.engine.optimizer.update_lp_params()


# ---- what the trainer calls -------------------------------------------------------------------

def layout_record(view: EngineView) -> dict[str, Any]:
    """The layout a checkpoint was written in: DeepSpeed's own files load only into the same one."""
    return {**view.ps.grid.layout_record(), "zero_stage": view.zero_stage, "dtype": view.dtype}


def save_universal(view: EngineView, directory: Path, state: dict[str, Any], lr_scheduler,
                   tokenizer_dir: Optional[Path] = None,
                   staging: Optional[HostStaging] = None) -> Union[dict, Callable[[], dict]]:
    """Write this rank's shard into `directory` (every rank; no collectives) and, on global rank 0,
    state.json (and a tokenizer copy). Returns the rank's record (sharded.write_rank_shard).

    `state` holds step, consumed_samples, model and whatever else the run wants in state.json.
    staging (a background save): copy this rank's chunks into its host buffers now and return the
    function that writes them (and rank 0's state.json) later."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    # read once, before any copy is queued: a read of a device step count after them would wait for them all
    optim_step = adam_step(view.base_optimizer)
    snapshot = staging.start() if staging is not None else None
    pieces = shard_pieces(view, with_optimizer=True, snapshot=snapshot)
    full_state = None
    if rank == 0:
        full_state = {**state, "version": universal.SHARDED_VERSION, "optim_step": optim_step,
                      "layout": layout_record(view), "lr_scheduler": jsonable(lr_scheduler.state_dict())}
        if scaler := loss_scaler_state(view.engine.optimizer):
            full_state["loss_scaler"] = scaler

    write = sharded.rank_writer(directory, rank, pieces, full_state, tokenizer_dir)
    return sharded.write_or_defer(write, snapshot)


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


def resume_universal(view: EngineView, directory: Path, lr_scheduler) -> dict[str, Any]:
    """Load a layout-free checkpoint into the running engine; return its state.json.

    The schedule comes from this run's config, its position from the checkpoint. A model-only
    checkpoint (no optimizer tensors) starts Adam fresh from its weights."""
    state = universal.read_state(directory)
    # another optimizer's state (a switch train.resume_accept_optimizer_change accepted): weights only
    own = same_optimizer(state, view.optimizer)
    load_shards(view, directory, int(state.get("optim_step", state["step"])) if own else None)
    step = int(state["step"])
    restore_schedule(lr_scheduler, int(state.get("lr_scheduler", {}).get("last_epoch", step)))
    restore_loss_scaler(view.engine.optimizer, state.get("loss_scaler", {}))
    view.engine.global_steps = step
    view.engine.global_samples = int(state["consumed_samples"])
    return state
