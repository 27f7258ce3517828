"""Expert parallelism as DeepSpeed's engine sees it.

DeepSpeed reduces a parameter marked `allreduce=False` (an expert: deepspeed_expert_marks) over
the expert-data-parallel group named by its `group_name`, and ZeRO-1/2 partition its optimizer
state over that group, but only once the engine believes the model has MoE layers, which it
decides by looking for its own MoE class, and only with that group registered in
deepspeed.utils.groups. ExpertGroupsMarker is that belief: a module without parameters, of
DeepSpeed's MoE class, whose set_deepspeed_parallelism (the engine calls it on every module that
has one) registers megaframe's ep and edp groups from the ParallelState, so the ranks are the
grid's (parallel/dims.py), not a second layout of DeepSpeed's making.

Under ZeRO-3 the engine refuses its own MoE class and takes experts only through its AutoEP layer
class: there the marker is of that class instead (ZeRO3ExpertGroupsMarker), and the experts carry
AutoEP's placement marks (parallel/experts.py), so zero.Init partitions each over its
expert-data-parallel ranks and stage 3 reduces its gradient there, as ZeRO-1/2 do.
"""
from __future__ import annotations

import torch.nn as nn
import functools

from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups

from megaframe.parallel.experts import ExpertGroup
from megaframe.parallel.state import ParallelState

MARKER_NAME = "deepspeed_expert_groups"


class _Marks:
    """Tells DeepSpeed's engine the model has experts, and which ranks hold and replicate them."""

    def _mark(self, ps: ParallelState, num_experts: int) -> None:
        nn.Module.__init__(self)  # DeepSpeed's own __init__ would build its gate and experts
        self.num_experts = num_experts
        self.ep_size = ps.grid.ep
        self.num_local_experts = num_experts // ps.grid.ep
        self.expert_group_name = self.ep_group_name = group_name(ps.grid.ep)
        self.__dict__["_ps"] = ps  # not a submodule

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  folding_group_handles=None) -> None:
        ps, name = self._ps, self.expert_group_name
        groups._EXPERT_PARALLEL_GROUP[name] = ps.group("ep")
        groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ps.group_ranks("ep")
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = ps.group("edp")
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = ps.group_ranks("edp")

    def forward(self, *args, **kwargs):
        raise RuntimeError("the expert-groups marker only informs DeepSpeed's engine; it computes nothing")


class ExpertGroupsMarker(_Marks, DeepSpeedMoE):
    """ZeRO-0/1/2: of DeepSpeed's MoE class, which those stages take."""

    def __init__(self, ps: ParallelState, num_experts: int):
        self._mark(ps, num_experts)


@functools.cache
def _zero3_marker_class() -> type:
    """ZeRO-3: a marker of DeepSpeed's AutoEP layer class, the only experts stage 3 takes (imported
    here: DeepSpeeds before AutoEP lack the module; the CLI refuses ZeRO-3 with ep > 1 there)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    class ZeRO3ExpertGroupsMarker(_Marks, AutoEPMoELayer):
        def __init__(self, ps: ParallelState, num_experts: int):
            self._mark(ps, num_experts)
    return ZeRO3ExpertGroupsMarker


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert-data-parallel group its MoE parameters reduce over."""
    return f"ep_size_{ep_size}"


def deepspeed_expert_marks(param: nn.Parameter, ep: ExpertGroup) -> None:
    """DeepSpeed's marks of an expert shard (ExpertGroup.engine_marks, set at construction, before
    zero.Init partitions it): allreduce=False and group_name make the engine reduce its gradient
    over the expert-data-parallel ranks. ZeRO-3 (DeepSpeed's AutoEP contract): zero.Init partitions
    a parameter over the group it carries here, the expert-data-parallel ranks, not all
    data-parallel ranks (which hold other experts); the family makes stage 3 average its gradient
    over the dense dp size and add its norm over the ep ranks. Stages 0-2 read none of those."""
    param.allreduce = False
    param.group_name = group_name(ep.size)
    param.ds_zero_placement_family = "autoep_expert"
    param.ds_zero_partition_group_name = group_name(ep.size)
    param.ds_zero_partition_process_group = ep.edp_group


def mark_expert_parallel(module: nn.Module, ps: ParallelState, zero_stage: int) -> None:
    """Attach the marker when experts are split over ep ranks (with ep=1 they are dense parameters)."""
    if ps.grid.ep == 1:
        return
    layers = getattr(module, "moe_layers", [])
    if layers:
        marker = _zero3_marker_class() if zero_stage == 3 else ExpertGroupsMarker
        module.add_module(MARKER_NAME, marker(ps, layers[0].moe.num_experts))
