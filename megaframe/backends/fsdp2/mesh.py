"""FSDP2's device meshes, built from megaframe's own process groups (no second world of groups).

Plain sharding: one dimension, the dp x cp ranks (cp ranks hold replicas of the weights too). HSDP
(parallel.dp_replicate = R > 1): the grid's dp_replicate x dp_shard axes (parallel/dims.py), R
replicas of a shard group of S = dp*cp/R consecutive ranks; FSDP shards within a group
(reduce-scatter, all-gather over S ranks, on a node when S fits one) and all-reduces gradients
across the replicas. Experts split over ep ranks shard over their expert-data-parallel ranks
instead (build.ExpertSharding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from megaframe.parallel.state import ParallelState


@dataclass(frozen=True)
class DataMesh:
    mesh: DeviceMesh
    shard_group: Any  # the ranks whose local shards are disjoint pieces of each parameter
    replica: int  # which replica this rank's shard group is (0 when not HSDP): replica 0 writes checkpoints


def data_mesh(ps: ParallelState, device_type: str) -> DataMesh:
    """The mesh fully_shard takes for dense parameters: (shard,) or, under HSDP, (replicate, shard)."""
    if ps.grid.dp_replicate == 1:
        group = ps.grad_reduce_group
        return DataMesh(DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",)), group, 0)
    # one row per replica of this rank's dp x cp ranks, in replica order: that replica's shard group
    rows = [ps.grid.group_of(rank, "dp_shard") for rank in ps.group_ranks("dp_replicate")]
    shard_group = ps.group("dp_shard")
    mesh = DeviceMesh.from_group([ps.group("dp_replicate"), shard_group], device_type, mesh=torch.tensor(rows),
                                 mesh_dim_names=("replicate", "shard"))
    return DataMesh(mesh, shard_group, ps.grid.coord(ps.rank, "dp_replicate"))
