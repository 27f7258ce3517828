"""The model as FSDP2 holds it: built with its parameters on the meta device, wrapped block by block
with fully_shard, then each rank's shard materialised and filled with its piece of the layout-free
initial value (model/gpt.py init_parameters): only that box is drawn (model/init_values.py), so no
rank draws or holds more of any parameter than its shard."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megaframe.model.gpt import Block, init_parameters
from megaframe.model.init_values import InitValue
from megaframe.model.moe import MoE

# What megaframe's parallel layers mark on a parameter (parallel/layers.py, parallel/experts.py).
# fully_shard replaces every parameter with a new DTensor one and these marks would be lost: they
# are kept by canonical name and put back on the sharded parameters.
MARKS = ("shard", "tensor_model_parallel", "partition_dim", "partition_shape", "partition_count", "partition_index")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside create their parameters on the meta device (no memory) and their
    buffers (positions, kv indices, expert biases: small) as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        if param is not None and param.device.type != "meta":
            marked = param
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            param.__dict__.update(marked.__dict__)  # a layer may mark its shard before registering it
        register(module, name, param)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def parameter_marks(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each parameter's marks by canonical name."""
    return {name: {mark: getattr(p, mark) for mark in MARKS if hasattr(p, mark)}
            for name, p in model.named_parameters()}


def restore_marks(model: nn.Module, marks: dict[str, dict[str, Any]]) -> None:
    for name, p in model.named_parameters():
        for mark, value in marks.get(name, {}).items():
            setattr(p, mark, value)


def compute_dtype(dtype: str) -> torch.dtype:
    """The dtype gathered parameters, activations and stored weights take for precision.dtype."""
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def policies(dtype: str, offload_cpu: bool, pin_memory: bool) -> dict[str, Any]:
    """fully_shard's mixed-precision and offload policies for precision.dtype and offload=cpu
    (pin_memory: offload.pin_memory). bf16: the sharded parameters (the optimizer's master) stay
    fp32, the gathered ones are bf16, and gradients are reduced in fp32 (as DeepSpeed's bf16
    optimizer accumulates them). Forward inputs are not cast: a block's hidden states arrive in bf16
    from the embedding already, and its RoPE tables must stay fp32 (apply_rope rotates in fp32)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False) \
        if dtype == "bf16" else MixedPrecisionPolicy()
    return {"mp_policy": mp, "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory) if offload_cpu else OffloadPolicy()}


@dataclass(frozen=True)
class ExpertSharding:
    """How experts split over ep ranks are sharded: over the ranks that hold the same experts
    (expert-data-parallel), their reduced gradient divided by the dense replicas (dp x cp), not by
    those ranks: an expert's gradient on one rank already sums the tokens every ep rank sent it."""

    mesh: DeviceMesh
    divide_by: int
    force_sum: bool  # the backend has no native average with a custom factor (gloo): reduce by sum


def shard_model(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool,
                experts: Optional[ExpertSharding] = None, **policy: Any) -> None:
    """fully_shard each block (its parameters gathered for its forward and backward only), then the
    root: embedding, final norm and head in one group, so a tied embedding is one parameter. Under
    expert parallelism each MoE layer's experts are a group of their own inside their block's,
    sharded over their expert-data-parallel ranks."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        if experts is not None and isinstance(block.mlp, MoE):
            # cut along each expert matrix's rows (dim 1), not the stack of local experts (dim 0):
            # a rank's few experts rarely divide by their replicas, and FSDP pads dim 0 up to a
            # multiple of them (one local expert over eight replicas: every rank a whole expert)
            fully_shard(block.mlp.experts, mesh=experts.mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=lambda param: Shard(1), **policy)
            block.mlp.experts.set_gradient_divide_factor(float(experts.divide_by))
            if experts.force_sum:
                block.mlp.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **policy)
    # the root's parameters are needed again right away by backward: keep them gathered
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **policy)


def reshard(model: nn.Module) -> None:
    """Free every gathered group: named_parameters() then yields the sharded DTensors again (a
    gathered group registers its plain full parameters in their place)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def local_box(param: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's local shard within the parameter's global (TP-shard) tensor."""
    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


@torch.no_grad()
def write_local_shard(param: nn.Parameter, value: InitValue) -> None:
    """Store this rank's FSDP shard of `value` (the parameter's TP shard): only its box is drawn."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    shape, offset = local_box(param) if isinstance(param, DTensor) else (tuple(local.shape), (0,) * local.dim())
    piece = value[tuple(slice(o, o + s) for o, s in zip(offset, shape))].tensor()
    local.copy_(piece.to(local.dtype))


def materialise(model: nn.Module, param_device: torch.device, compute_device: torch.device, dims, seed: int,
                marks: dict[str, dict[str, Any]]) -> None:
    """Give the meta parameters this rank's memory on param_device (the host under CPU offload), put
    their marks back (to_empty replaces each DTensor parameter with a new one) and fill each shard
    from the layout-invariant initial value. The buffers keep their values and go where the forward
    runs (compute_device): FSDP2 moves only the parameters it offloads."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=param_device)
    restore_marks(model, marks)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(compute_device)
    init_parameters(model, "", dims, seed, write=write_local_shard)
