"""ParallelState: this rank's place in the ParallelDims grid and its process groups, passed
explicitly to whatever needs them (no module-level groups).

The degrees and the rank layout are ParallelDims' (parallel/dims.py); this object only adds the
process groups, created once on every rank in the same order. Axes of degree 1 get groups of one
rank too: DeepSpeed's mpu consumers pass them to collectives and refuse None.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megaframe.parallel.dims import OnGrid, ParallelDims, RankCoords

# The groups a run may use, each created once (groups with the same members share one).
# ("dp", "cp") reduces dense gradients; ("ep",) and ("edp",) shard and reduce experts.
GROUP_AXES = (("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"), ("ep",), ("edp",))
# HSDP's shard and replica groups, created only on a grid with dp_replicate > 1.
HSDP_GROUP_AXES = (("dp_shard",), ("dp_replicate",))


def group_axes(grid: ParallelDims) -> tuple[tuple[str, ...], ...]:
    """The axes ParallelState.build creates groups along on `grid`."""
    return GROUP_AXES + (HSDP_GROUP_AXES if grid.dp_replicate > 1 else ())


class ParallelState(OnGrid):
    """The grid's degrees (from `grid`), this rank's coordinates and its process groups."""

    def __init__(self, grid: ParallelDims, rank: int, groups: Optional[dict[tuple[str, ...], object]] = None):
        self.grid = grid
        self.rank = rank
        self.coords: RankCoords = grid.coords(rank)
        self._groups = groups or {}

    @classmethod
    def build(cls, grid: ParallelDims, reuse: Optional["ParallelState"] = None) -> "ParallelState":
        """Create the groups on an initialised default process group (every rank must call this).
        `reuse`: a state of the same ranks whose groups are kept (only the missing ones are created)."""
        if not dist.is_initialized():
            return cls(grid, rank=0)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != grid.world_size:
            raise RuntimeError(f"{grid.describe()} needs {grid.world_size} ranks but the process group has {world}")
        by_members: dict[tuple[int, ...], object] = {}
        # what `reuse` created, decided by arithmetic alone: every rank must skip the same groups
        created: set[tuple[int, ...]] = set()
        if reuse is not None:
            for axes in group_axes(reuse.grid):
                created.update(tuple(ranks) for ranks in reuse.grid.groups(*axes))
                by_members[tuple(reuse.group_ranks(*axes))] = reuse.group(*axes)
        mine: dict[tuple[str, ...], object] = {}
        # new_group is collective over the world: every rank creates every group in the same order.
        for axes in group_axes(grid):
            for ranks in grid.groups(*axes):
                key = tuple(ranks)
                if key not in by_members and key not in created:
                    by_members[key] = dist.new_group(ranks=ranks)
                if rank in ranks:
                    mine[axes] = by_members[key]
        return cls(grid, rank, groups=mine)

    def group(self, *axes: str):
        """This rank's process group along `axes` (None when this state was made without process
        groups: ParallelState(grid, rank) rather than build)."""
        if self._groups and axes not in self._groups:
            raise KeyError(f"no process group along {axes}: ParallelState.build creates {group_axes(self.grid)}")
        return self._groups.get(axes)

    def group_ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group along `axes`."""
        return self.grid.group_of(self.rank, *axes)

    def tp_region(self, sequence_parallel: bool = False, grad_bucket=None, matmul=None):
        """The TPGroup that tensor-parallel layers take (grad_bucket: parallel/grad_bucket.py;
        matmul: the MatmulRecipe of the model's weight matmuls, parallel/matmul.py; None: default)."""
        from megaframe.parallel.layers import TPGroup

        recipe = {} if matmul is None else {"matmul": matmul}
        return TPGroup(group=self.tp_group if self.tp > 1 else None, size=self.tp, rank=self.tp_rank,
                       sequence_parallel=sequence_parallel and self.tp > 1,
                       grad_bucket=grad_bucket if self.tp > 1 else None, **recipe)

    # ---- coordinates (RankCoords', by name; the degrees come from OnGrid) ----------------------
    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    def context(self):
        """The ContextGroup of this rank's sequence (parallel/context.py), None while cp is 1."""
        if self.grid.cp == 1:
            return None
        from megaframe.parallel.context import ContextGroup

        ranks = tuple(self.group_ranks("cp"))  # ascending ranks are cp order: cp is the next-fastest axis
        return ContextGroup(self.group("cp"), ranks, ranks.index(self.rank))

    def experts(self, engine_marks=None):
        """The ExpertGroup of this rank (model/moe.py): its ep group, size and ep rank, and what the
        engine marks on each expert shard (engine_marks(param, group); None: nothing)."""
        from megaframe.parallel.experts import ExpertGroup

        if self.grid.ep == 1:
            return ExpertGroup()
        return ExpertGroup(self.group("ep"), self.grid.ep, self.coords.ep, self.group("edp"), engine_marks)

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def dp_group(self):
        """The data-sharding group (which samples a rank reads)."""
        return self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def grad_reduce_group(self):
        """Where dense gradients are averaged: dp x cp (the same ranks as dp while cp is 1)."""
        return self.group("dp", "cp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group."""
        return self.group_ranks("dp")

    def __repr__(self) -> str:
        return f"ParallelState({self.grid.describe()}, rank={self.rank}, coords={self.coords})"
