"""What a DeepSpeed engine actually holds as model states on this rank, in bytes, by role.

Walks engine.module's parameters (ZeRO-3: their ds_tensor partitions) and every tensor reachable
from engine.optimizer, counting each storage once (DeepSpeed flattens parameters, gradients and
fp32 partitions into shared buffers; views of one buffer must not be counted twice), and sorts
them into the ZeRO paper's categories plus what the paper does not model:

- weights: the training-precision parameters (bf16 under mixed precision);
- gradients: training-precision gradients (param.grad, ZeRO's gradient partitions);
- optimizer: fp32 master weights and Adam's m and v (the paper's K=12 under mixed precision; in
  fp32 training the master weights are the weights, so only m and v);
- buckets: communication buffers sized by zero.reduce_bucket_size, not by the model;
- other: anything else (e.g. fp32 copies of gradients some optimizers keep), reported separately.
"""
from __future__ import annotations

from typing import Any

import torch

_MAX_DEPTH = 6
# Where DeepSpeed keeps fp32 master weights outside the inner optimizer's param_groups (ZeRO-3 swaps
# its sub-group partitions in only during step); a master's .grad is not a master.
_MASTER_WEIGHTS = ("fp32_partitioned_groups_flat[", "single_partition_of_fp32_groups[", "fp32_groups_flat[")


def _walk(obj: Any, path: str, found: dict, visited: set, depth: int = 0) -> None:
    if depth > _MAX_DEPTH or id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.untyped_storage().nbytes():
            storage = obj.untyped_storage()
            found.setdefault(storage.data_ptr(), (storage.nbytes(), path, obj))
        if obj.grad is not None:
            _walk(obj.grad, path + ".grad", found, visited, depth + 1)
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, f"{path}[{key if isinstance(key, (str, int)) else '*'}]", found, visited, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", found, visited, depth + 1)
    elif (hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type))
          and type(obj).__module__.startswith(("deepspeed", "torch.optim", "megaframe.optim"))):  # Muon: a client optimizer
        for key, value in vars(obj).items():
            _walk(value, f"{path}.{key}", found, visited, depth + 1)


def held_model_states(engine) -> dict[str, int]:
    """Bytes this rank holds, by category (see the module docstring)."""
    params = list(engine.module.parameters())
    weight_storages = {}
    for p in params:
        held = getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p
        if held is not None and held.untyped_storage().nbytes():
            weight_storages[held.untyped_storage().data_ptr()] = held.untyped_storage().nbytes()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO / bf16 wrappers hold torch's Adam
    optimizer_storages = {}
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                optimizer_storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    train_dtype = next(p.dtype for p in params)
    if train_dtype != torch.float32:
        # mixed precision: the fp32 master weights the inner optimizer steps on are optimizer states
        # (fp32 training: DeepSpeed's ZeRO keeps an fp32 clone of the partition, which the paper does
        # not count; it lands in "other")
        for group in inner.param_groups:
            for master in group["params"]:
                storage = master.untyped_storage()
                if storage.data_ptr() not in weight_storages:
                    optimizer_storages[storage.data_ptr()] = storage.nbytes()
    found: dict = {}
    visited: set = set()
    for i, p in enumerate(params):
        _walk(p, f"module.{i}", found, visited)
        if hasattr(p, "ds_tensor"):
            _walk(p.ds_tensor, f"module.{i}.ds_tensor", found, visited)
    _walk(engine.optimizer, "optimizer", found, visited)
    totals = {"weights": 0, "gradients": 0, "optimizer": 0, "buckets": 0, "other": 0}
    for ptr, (nbytes, path, tensor) in found.items():
        if ptr in weight_storages:
            totals["weights"] += nbytes
        elif ptr in optimizer_storages or (train_dtype != torch.float32 and tensor.dtype == torch.float32
                                           and any(name in path for name in _MASTER_WEIGHTS)):
            totals["optimizer"] += nbytes
        elif "ipg" in path:  # DeepSpeed's reduce buckets (zero.reduce_bucket_size elements)
            totals["buckets"] += nbytes
        elif tensor.dtype == train_dtype and (path.endswith(".grad") or "grad" in path.rsplit(".", 1)[-1]):
            totals["gradients"] += nbytes
        else:
            totals["other"] += nbytes
    return totals
