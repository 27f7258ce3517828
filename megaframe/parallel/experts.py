"""ExpertGroup: what an expert layer needs to know about expert parallelism (parallel.ep), as
TPGroup is for tensor parallelism; and the marks an expert shard carries (an engine's own, such
as how DeepSpeed reduces and partitions it, come from the engine through engine_marks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn

from megaframe.parallel.layers import ShardSpec


@dataclass(frozen=True)
class ExpertGroup:
    """The expert-parallel ranks of this rank (parallel.ep): each holds num_experts/size experts."""

    group: Any = None
    size: int = 1
    rank: int = 0
    edp_group: Any = None  # the ranks holding the same experts: a sharding engine partitions experts over them
    engine_marks: Optional[Callable[[nn.Parameter, "ExpertGroup"], None]] = None  # the engine's own marks


def mark_expert_shard(param: nn.Parameter, full_shape: tuple[int, ...], ep: ExpertGroup) -> nn.Parameter:
    """`param` holds experts [rank*E/ep, (rank+1)*E/ep) of a full (E, ...) tensor; with ep > 1 the
    engine marks it too (its gradient is reduced over the expert-data-parallel ranks, not all
    data-parallel ones: each engine has its own way of being told)."""
    param.shard = ShardSpec("ep", 0)
    param.partition_dim = 0
    param.partition_shape = tuple(full_shape)
    param.partition_count = ep.size
    param.partition_index = ep.rank
    # with one ep rank every data-parallel rank holds every expert: a dense parameter
    if ep.size > 1 and ep.engine_marks is not None:
        ep.engine_marks(param, ep)
    return param
