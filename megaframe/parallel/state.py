"""ParallelState: the rank grid and its process groups, passed explicitly to whatever needs them.

The grid comes from DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model; model
fastest), the same object a PipelineModule uses, so our groups and the pipeline engine's agree.
The object also implements the Megatron `mpu` interface that deepspeed.initialize(mpu=...) reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the (pp, dp, tp) grid."""

    pp_rank: int
    dp_rank: int
    tp_rank: int


def build_topology(tp: int, pp: int, dp: int) -> PipeModelDataParallelTopology:
    """The one topology object both ParallelState and PipelineModule use."""
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def rank_coords(tp: int, pp: int, dp: int, rank: int) -> RankCoords:
    """Pure mapping rank -> coordinates (tp fastest, then dp, then pp)."""
    coord = build_topology(tp, pp, dp).get_coord(rank)
    return RankCoords(pp_rank=coord.pipe, dp_rank=coord.data, tp_rank=coord.model)


class ParallelState:
    """Degrees, this rank's coordinates and its tp / dp / pp process groups."""

    def __init__(self, tp: int, pp: int, dp: int, rank: int, groups: Optional[dict] = None):
        self.tp, self.pp, self.dp = tp, pp, dp
        self.world_size = tp * pp * dp
        self.rank = rank
        self.topology = build_topology(tp, pp, dp)
        self.coords = rank_coords(tp, pp, dp, rank)
        groups = groups or {}
        self.tp_group = groups.get("model")
        self.dp_group = groups.get("data")
        self.pp_group = groups.get("pipe")
        self._group_ranks = {axis: self._ranks_along(axis) for axis in ("model", "data", "pipe")}

    @classmethod
    def build(cls, tp: int, pp: int, dp: int) -> "ParallelState":
        """Create the groups on an initialised default process group (every rank must call this)."""
        if not dist.is_initialized():
            return cls(tp, pp, dp, rank=0)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != tp * pp * dp:
            raise RuntimeError(f"tp*pp*dp={tp * pp * dp} but the process group has {world} ranks")
        topo = build_topology(tp, pp, dp)
        mine = {}
        # new_group is collective over the world: every rank creates every group in the same order.
        for axis in ("model", "data", "pipe"):
            for ranks in topo.get_axis_comm_lists(axis):
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    mine[axis] = group
        return cls(tp, pp, dp, rank, groups=mine)

    def _ranks_along(self, axis: str) -> list[int]:
        for ranks in self.topology.get_axis_comm_lists(axis):
            if self.rank in ranks:
                return ranks
        return [self.rank]  # an axis of size 1 has no comm list

    def tp_region(self, sequence_parallel: bool = False):
        """The TPGroup that tensor-parallel layers take."""
        from megaframe.parallel.layers import TPGroup

        return TPGroup(group=self.tp_group if self.tp > 1 else None, size=self.tp, rank=self.tp_rank,
                       sequence_parallel=sequence_parallel and self.tp > 1)

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def pp_rank(self) -> int:
        return self.coords.pp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group."""
        return self._group_ranks["data"]

    # ---- the Megatron `mpu` interface DeepSpeed calls -----------------------------------------
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._group_ranks["model"][0]

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    def get_pipeline_model_parallel_group(self):
        return self.pp_group

    def __repr__(self) -> str:
        return (f"ParallelState(tp={self.tp}, pp={self.pp}, dp={self.dp}, rank={self.rank}, "
                f"coords={self.coords})")
