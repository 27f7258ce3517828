"""FSDP2's device meshes, built from megaframe's own process groups (no second world of groups).

Plain sharding: one dimension, the dp x cp ranks (cp ranks hold replicas of the weights too). HSDP
(parallel.dp_replicate = R > 1): those ranks as R replicas of a shard group of S = dp*cp/R
consecutive ranks; FSDP shards within a group (reduce-scatter, all-gather over S ranks, on a node
when S fits one) and all-reduces gradients across the replicas. Experts split over ep ranks shard
over their expert-data-parallel ranks instead (build.ExpertSharding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megaframe.parallel.state import ParallelState


@dataclass(frozen=True)
class DataMesh:
    mesh: DeviceMesh
    shard_group: Any  # the ranks whose local shards are disjoint pieces of each parameter
    replica: int  # which replica this rank's shard group is (0 when not HSDP): replica 0 writes checkpoints


def data_mesh(ps: ParallelState, replicas: int, device_type: str) -> DataMesh:
    """The mesh fully_shard takes for dense parameters. Every rank creates every HSDP group, in
    the same order (new_group is collective over the world)."""
    if replicas == 1:
        group = ps.grad_reduce_group
        return DataMesh(DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",)), group, 0)
    mine = None
    for ranks in ps.grid.groups("dp", "cp"):
        size = len(ranks) // replicas
        blocks = [ranks[i * size:(i + 1) * size] for i in range(replicas)]
        shard_groups = [dist.new_group(block) for block in blocks]
        replicate_groups = [dist.new_group(ranks[j::size]) for j in range(size)]
        if ps.rank in ranks:
            at = ranks.index(ps.rank)
            mine = (blocks, replicate_groups[at % size], shard_groups[at // size], at // size)
    blocks, replicate_group, shard_group, replica = mine
    mesh = DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=torch.tensor(blocks),
                                 mesh_dim_names=("replicate", "shard"))
    return DataMesh(mesh, shard_group, replica)
