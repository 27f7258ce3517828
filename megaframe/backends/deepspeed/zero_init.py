"""ZeRO-3 models built partitioned: no rank ever holds the whole model.

Without this, every rank constructs and initialises the full model and deepspeed.initialize
partitions it afterwards: a 70B model needs 280 GB of fp32 on every rank before the first step.
Under deepspeed.zero.Init each module's parameters are partitioned over the data-parallel group (an
expert over its expert-data-parallel ranks: the group it carries, parallel/experts.py) as soon as
that module is constructed, and init_parameters then writes each rank's piece of the
layout-invariant initial value straight into its partition (drawing only that range), so
the weights equal those of every other layout. zero.Init's own broadcast of the constructed values
is overwritten by that write.

Not under offload.param=nvme: there zero.Init would send the partitions to NVMe before their values
are written; those runs build the model whole and let deepspeed.initialize partition it.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from megaframe.backends.deepspeed.topology import MegatronMpu
from megaframe.model.init_values import InitValue
from megaframe.parallel.state import ParallelState


def builds_partitioned(zero_stage: int, offload_param: str, pipelined: bool) -> bool:
    """Whether the model is constructed under zero.Init (ZeRO-3, no pipeline, parameters not on NVMe)."""
    return zero_stage == 3 and offload_param != "nvme" and not pipelined


def partitioned_construction(ds_config: dict[str, Any], ps: ParallelState) -> contextlib.AbstractContextManager:
    """The context the model is built in: parameters partitioned over the DP group on creation.

    torch._dynamo is imported first: zero.Init replaces torch.Tensor.__new__, and dynamo, when
    first imported under it (torch imports it lazily, e.g. for the RNG state a dropout stream sets),
    refuses the replaced signature with a TypeError. megaframe no longer imports dynamo at start-up
    (compile_breaks.py), so a ZeRO-3 build is where it must come in."""
    importlib.import_module("torch._dynamo")  # `import torch._dynamo` would rebind torch locally

    return deepspeed.zero.Init(data_parallel_group=ps.grad_reduce_group, config_dict_or_path=ds_config, mpu=MegatronMpu(ps))


def partition_range(param: torch.nn.Parameter, numel: int) -> tuple[int, int]:
    """[start, stop) of the flattened parameter (numel elements) in this rank's ZeRO-3 partition:
    ds_numel elements from rank * ds_numel, cut at the end (ds_numel is known also when NVMe holds
    the partition's data)."""
    size = param.ds_tensor.ds_numel
    rank = dist.get_rank(group=param.ds_process_group)
    return min(rank * size, numel), min((rank + 1) * size, numel)


@torch.no_grad()
def write_partition(param: torch.nn.Parameter, value: InitValue) -> None:
    """Store this rank's ZeRO-3 partition of `value` (the parameter's tensor-parallel shard, drawn
    only over the partition's range), zeros past its end."""
    partition = param.ds_tensor
    start, stop = partition_range(param, value.numel())
    partition.data.zero_()
    partition.data[: stop - start].copy_(value.flat(start, stop).to(partition.dtype))


def built_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """A parameter's shape as the model built it: one partitioned at construction is empty here,
    and zero.Init keeps its shape as ds_shape."""
    return tuple(getattr(param, "ds_shape", param.shape))


def gathered_numel(param: torch.nn.Parameter) -> int:
    """A parameter's elements as the model built it (ds_numel when partitioned at construction)."""
    return getattr(param, "ds_numel", param.numel())
