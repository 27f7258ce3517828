"""ParallelDims: the parallel degrees and the rank <-> coordinates map, the only place they live.

Ranks are laid out as Megatron lays them out: tp fastest, then cp, then dp, then pp, so a
tensor-parallel group is a run of neighbouring ranks (one NVLink island) and pipeline stages are
the farthest apart:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Expert parallelism does not add ranks: it is folded into the dp x cp ranks of one (pp, tp)
position. Their flattened index `dp_rank * cp + cp_rank` splits into ep_rank (fastest) and
edp_rank, the expert-data-parallel coordinate:

    ep_rank = (dp_rank * cp + cp_rank) % ep,   edp_rank = (dp_rank * cp + cp_rank) // ep

so experts are sharded over ep ranks and each expert's gradient is reduced over edp ranks.

HSDP (dp_replicate = R > 1) takes a second view of the same flattened index: R replicas (slow) of a
shard group of dp_shard = dp*cp/R neighbouring ranks (fast), as torchtitan's dp_replicate x dp_shard
mesh (here the shard group spans cp too: cp ranks hold replicas of the weights):

    dp_replicate_rank = (dp_rank * cp + cp_rank) // dp_shard,   dp_shard_rank = (...) % dp_shard

FSDP shards within a dp_shard group and all-reduces across a dp_replicate group; data is still
sharded over all dp ranks (the dp axis), whatever R is.
Everything here is arithmetic: the process groups live in ParallelState (parallel/state.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Axes that own ranks, slowest first (the layout formula above).
RANK_AXES = ("pp", "dp", "cp", "tp")
# The view expert layers take of the same ranks: dp x cp split into edp (slow) and ep (fast).
EXPERT_AXES = ("pp", "edp", "ep", "tp")
# HSDP's view of them: dp x cp split into dp_replicate (slow) and dp_shard (fast).
HSDP_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
# The views that split dp x cp, by their own axes: groups along one view's axes never mix in another's.
_VIEWS = (EXPERT_AXES, HSDP_AXES)
# The degrees a run is recorded and compared by (parallel.<axis>), in the order records list them;
# a new axis added here reaches run records, layout records and resume lines with no edit there.
LAYOUT_AXES = ("tp", "pp", "dp", "cp", "ep")
# Axes every layout record holds; the others only above 1, so records written before they existed match.
_ALWAYS_RECORDED = ("tp", "pp", "dp")


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits on every axis, the expert view's ep and edp included."""

    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline, data, context, expert and tensor parallelism (world = pp*dp*cp*tp), and
    HSDP's replicas of the data-parallel ranks (dp_replicate)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for axis in ("pp", "dp", "cp", "ep", "tp", "dp_replicate"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{axis}={value!r} must be a positive integer")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide dp*cp={self.dp * self.cp}: expert "
                             "parallelism shares the data- and context-parallel ranks")
        if (self.dp * self.cp) % self.dp_replicate:
            raise ValueError(f"parallel.dp_replicate={self.dp_replicate} must divide dp*cp={self.dp * self.cp}: "
                             "HSDP's replicas are equal shard groups of the data- and context-parallel ranks")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the replicas of each expert."""
        return self.dp * self.cp // self.ep

    @property
    def dp_shard(self) -> int:
        """HSDP's shard-group size: the dp x cp ranks of one replica (all of them without HSDP)."""
        return self.dp * self.cp // self.dp_replicate

    def size(self, *axes: str) -> int:
        """Ranks in one group along `axes` (1 for no axes)."""
        _check_axes(axes)
        n = 1
        for axis in axes:
            n *= getattr(self, axis)
        return n

    def degrees(self) -> dict[str, int]:
        """Every layout axis' degree, in LAYOUT_AXES order (a run record's layout)."""
        return {axis: getattr(self, axis) for axis in LAYOUT_AXES}

    def layout_record(self) -> dict[str, int]:
        """The degrees of a checkpoint's layout record: tp, pp and dp always, every other axis (HSDP's
        dp_replicate included) only above 1."""
        return {axis: getattr(self, axis) for axis in (*LAYOUT_AXES, "dp_replicate")
                if axis in _ALWAYS_RECORDED or getattr(self, axis) > 1}

    @staticmethod
    def same_layout(saved: dict, now: dict) -> bool:
        """Whether two layout records (layout_record plus an engine's keys) name one layout: an axis
        a record leaves out is 1 (records list an axis only above 1, and older ones never listed
        some, e.g. FSDP2's before ep), every other key must match."""
        axes = (*LAYOUT_AXES, "dp_replicate")
        fill = lambda record: {**{axis: 1 for axis in axes}, **record}  # noqa: E731
        return fill(saved) == fill(now)

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of `rank` on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        rank, tp_rank = divmod(rank, self.tp)
        rank, cp_rank = divmod(rank, self.cp)
        pp_rank, dp_rank = divmod(rank, self.dp)
        edp_rank, ep_rank = divmod(dp_rank * self.cp + cp_rank, self.ep)
        return RankCoords(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank, ep=ep_rank, edp=edp_rank)

    def coord(self, rank: int, axis: str) -> int:
        """The coordinate of `rank` on one axis, HSDP's dp_replicate and dp_shard included."""
        _check_axes((axis,))
        return _on_axis(self, self.coords(rank), axis)

    def rank(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The rank at these coordinates (the inverse of coords on the rank axes)."""
        for axis, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis} coordinate {value} is outside degree {getattr(self, axis)}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group along `axes`: ranks that differ only on those axes, each list ascending,
        the lists ordered by their first rank. `groups("dp", "cp")` is the gradient-reduction
        group of dense parameters, `groups("ep")` and `groups("edp")` those of the experts,
        `groups("dp_shard")` and `groups("dp_replicate")` HSDP's shard and replica groups."""
        _check_axes(axes)
        return [list(ranks) for ranks in _groups(self, axes)]

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The group along `axes` that holds `rank`."""
        _check_axes(axes)
        return list(_group_of_rank(self, axes)[rank])

    def describe(self, style: str = "text") -> "str | dict[str, int]":
        """The one spelling of a layout: tp, pp and dp, then cp, ep and HSDP's dp_replicate only when
        used. text: `tp=2 pp=1 dp=4 ep=2` (start-up line, plans, errors); name: `tp2pp1dp4ep2` (W&B run
        names); record: {"tp": 2, "pp": 1, "dp": 4, "ep": 2} (run metadata)."""
        used = {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                **{a: getattr(self, a) for a in ("cp", "ep", "dp_replicate") if getattr(self, a) > 1}}
        if style == "record":
            return used
        sep, join = {"text": ("=", " "), "name": ("", "")}[style]
        return join.join(f"{axis}{sep}{degree}" for axis, degree in used.items())


class OnGrid:
    """Mixin for objects that hold a ParallelDims as `grid`: their tp, pp, dp and world_size are
    the grid's, never copies of it."""

    grid: ParallelDims

    @property
    def tp(self) -> int:
        return self.grid.tp

    @property
    def pp(self) -> int:
        return self.grid.pp

    @property
    def dp(self) -> int:
        return self.grid.dp

    @property
    def cp(self) -> int:
        return self.grid.cp

    @property
    def world_size(self) -> int:
        return self.grid.world_size


# Computed once per (grid, axes): the collective setup and DeepSpeed's mpu calls ask repeatedly,
# and one pass over the world is O(world) work (3,072 ranks for gpt_1t).
@lru_cache(maxsize=None)
def _groups(grid: ParallelDims, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    system = next((view for view in _VIEWS if set(view) & set(axes) - set(RANK_AXES)), RANK_AXES)
    fixed = [axis for axis in system if axis not in axes]
    by_fixed: dict[tuple[int, ...], list[int]] = {}
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        by_fixed.setdefault(tuple(_on_axis(grid, c, axis) for axis in fixed), []).append(rank)
    return tuple(sorted(tuple(ranks) for ranks in by_fixed.values()))


def _on_axis(grid: ParallelDims, c: RankCoords, axis: str) -> int:
    """One coordinate: RankCoords' own, or HSDP's split of the flattened dp x cp index."""
    if axis in ("dp_replicate", "dp_shard"):
        replica, position = divmod(c.dp * grid.cp + c.cp, grid.dp_shard)
        return replica if axis == "dp_replicate" else position
    return getattr(c, axis)


@lru_cache(maxsize=None)
def _group_of_rank(grid: ParallelDims, axes: tuple[str, ...]) -> dict[int, tuple[int, ...]]:
    return {rank: ranks for ranks in _groups(grid, axes) for rank in ranks}


def _check_axes(axes: tuple[str, ...]) -> None:
    known = set(RANK_AXES).union(*_VIEWS)
    unknown = [a for a in axes if a not in known]
    if unknown:
        raise ValueError(f"unknown parallel axes {unknown}; known: {sorted(known)}")
    views = [view for view in _VIEWS if set(view) & set(axes) - set(RANK_AXES)]
    if len(views) > 1:
        raise ValueError(f"axes {list(axes)} mix the expert view (ep, edp) with HSDP's (dp_replicate, dp_shard)")
    if views and {"dp", "cp"} & set(axes):
        own = [a for a in views[0] if a not in RANK_AXES]
        name = "the expert view" if views[0] is EXPERT_AXES else "HSDP's view"
        raise ValueError(f"axes {list(axes)} mix {name} ({', '.join(own)}) with dp/cp, which it splits")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {list(axes)} repeat an axis")

