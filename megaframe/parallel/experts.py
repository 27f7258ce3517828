"""ExpertGroup: what an expert layer needs to know about expert parallelism (parallel.ep), as
TPGroup is for tensor parallelism; and the marks an expert shard carries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from megaframe.parallel.layers import ShardSpec


@dataclass(frozen=True)
class ExpertGroup:
    """The expert-parallel ranks of this rank (parallel.ep): each holds num_experts/size experts."""

    group: Any = None
    size: int = 1
    rank: int = 0
    edp_group: Any = None  # the ranks holding the same experts: ZeRO-3 partitions experts over them

    @property
    def group_name(self) -> str:
        """DeepSpeed's name for the expert-data-parallel group its MoE parameters reduce over."""
        return f"ep_size_{self.size}"


def mark_expert_shard(param: nn.Parameter, full_shape: tuple[int, ...], ep: ExpertGroup) -> nn.Parameter:
    """`param` holds experts [rank*E/ep, (rank+1)*E/ep) of a full (E, ...) tensor. allreduce=False and
    group_name are DeepSpeed's marks of an expert parameter: its gradient is reduced over the
    expert-data-parallel ranks, not all data-parallel ones."""
    param.shard = ShardSpec("ep", 0)
    param.partition_dim = 0
    param.partition_shape = tuple(full_shape)
    param.partition_count = ep.size
    param.partition_index = ep.rank
    if ep.size > 1:  # with one ep rank every data-parallel rank holds every expert: a dense parameter
        param.allreduce = False
        param.group_name = ep.group_name
        # ZeRO-3 (DeepSpeed's AutoEP contract): zero.Init partitions a parameter over the group it
        # carries here, the expert-data-parallel ranks, not all data-parallel ranks (which hold
        # other experts); the family makes stage 3 average its gradient over the dense dp size and
        # add its norm over the ep ranks. Stages 0-2 read none of these.
        param.ds_zero_placement_family = "autoep_expert"
        param.ds_zero_partition_group_name = ep.group_name
        param.ds_zero_partition_process_group = ep.edp_group
    return param
