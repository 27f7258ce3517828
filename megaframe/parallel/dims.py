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
Everything here is arithmetic: the process groups live in ParallelState (parallel/state.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Axes that own ranks, slowest first (the layout formula above).
RANK_AXES = ("pp", "dp", "cp", "tp")
# The view expert layers take of the same ranks: dp x cp split into edp (slow) and ep (fast).
EXPERT_AXES = ("pp", "edp", "ep", "tp")


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
    """Degrees of pipeline, data, context, expert and tensor parallelism (world = pp*dp*cp*tp)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in ("pp", "dp", "cp", "ep", "tp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{axis}={value!r} must be a positive integer")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide dp*cp={self.dp * self.cp}: expert "
                             "parallelism shares the data- and context-parallel ranks")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the replicas of each expert."""
        return self.dp * self.cp // self.ep

    def size(self, *axes: str) -> int:
        """Ranks in one group along `axes` (1 for no axes)."""
        _check_axes(axes)
        n = 1
        for axis in axes:
            n *= getattr(self, axis)
        return n

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of `rank` on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        rank, tp_rank = divmod(rank, self.tp)
        rank, cp_rank = divmod(rank, self.cp)
        pp_rank, dp_rank = divmod(rank, self.dp)
        edp_rank, ep_rank = divmod(dp_rank * self.cp + cp_rank, self.ep)
        return RankCoords(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank, ep=ep_rank, edp=edp_rank)

    def rank(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The rank at these coordinates (the inverse of coords on the rank axes)."""
        for axis, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis} coordinate {value} is outside degree {getattr(self, axis)}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group along `axes`: ranks that differ only on those axes, each list ascending,
        the lists ordered by their first rank. `groups("dp", "cp")` is the gradient-reduction
        group of dense parameters, `groups("ep")` and `groups("edp")` those of the experts."""
        _check_axes(axes)
        return [list(ranks) for ranks in _groups(self, axes)]

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The group along `axes` that holds `rank`."""
        _check_axes(axes)
        return list(_group_of_rank(self, axes)[rank])

    def describe(self, style: str = "text") -> "str | dict[str, int]":
        """The one spelling of a layout: tp, pp and dp, then cp and ep only when used. text:
        `tp=2 pp=1 dp=4 ep=2` (start-up line, plans, errors); name: `tp2pp1dp4ep2` (W&B run names);
        record: {"tp": 2, "pp": 1, "dp": 4, "ep": 2} (run metadata)."""
        used = {"tp": self.tp, "pp": self.pp, "dp": self.dp, **{a: getattr(self, a) for a in ("cp", "ep")
                                                                  if getattr(self, a) > 1}}
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
    system = EXPERT_AXES if {"ep", "edp"} & set(axes) else RANK_AXES
    fixed = [axis for axis in system if axis not in axes]
    by_fixed: dict[tuple[int, ...], list[int]] = {}
    for rank in range(grid.world_size):
        c = grid.coords(rank)
        by_fixed.setdefault(tuple(getattr(c, axis) for axis in fixed), []).append(rank)
    return tuple(sorted(tuple(ranks) for ranks in by_fixed.values()))


@lru_cache(maxsize=None)
def _group_of_rank(grid: ParallelDims, axes: tuple[str, ...]) -> dict[int, tuple[int, ...]]:
    return {rank: ranks for ranks in _groups(grid, axes) for rank in ranks}


def _check_axes(axes: tuple[str, ...]) -> None:
    known = set(RANK_AXES) | set(EXPERT_AXES)
    unknown = [a for a in axes if a not in known]
    if unknown:
        raise ValueError(f"unknown parallel axes {unknown}; known: {sorted(known)}")
    if {"ep", "edp"} & set(axes) and {"dp", "cp"} & set(axes):
        raise ValueError(f"axes {list(axes)} mix the expert view (ep, edp) with dp/cp, which it splits")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {list(axes)} repeat an axis")

