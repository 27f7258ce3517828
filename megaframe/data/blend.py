"""Weighted blends of datasets with Megatron-LM's semantics, layout-invariant and resumable.

Blend position p (the p-th sample of the run, p = step * global_batch_size + j) comes from the source
furthest below its target share, as Megatron's build_blending_indices decides: the source d with
the largest weight[d] * max(i, 1) - taken[d], ties to the first, where i counts the samples of the
current stage and taken[d] the source's samples in it. A source's n-th sample overall is sample
n mod N of that source in the order of its epoch n // N, a permutation seeded by (seed, source,
epoch). So what step k trains on depends only on (seed, k, global batch size): not on the
data-parallel size, the micro-batch size, or whether the run was resumed.

Weight schedules (data.blend_schedule) split the run into stages at step boundaries. Each stage
starts its deficits afresh (a new stage does not make up for the previous one's shares); each
source's count carries over, so no sample is repeated before its source's epoch ends.

Finding where position p stands means walking the greedy rule from the start of its stage: the
walk is plain Python at about a microsecond per sample per source. The trainer keeps a cursor that
moves forward a step at a time, and a checkpoint stores it, so neither training nor resuming walks
from zero; only an out-of-order question (a test, a resumed run whose checkpoint lacks the cursor)
does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megaframe.config import blend_spec
from megaframe.data.dataset import SampleSet, windows_batch
from megaframe.data.epoch_orders import IN_MEMORY, EpochOrders
from megaframe.data.indexed import DataError

__all__ = ["BlendCursor", "BlendedSamples", "Stage", "normalized", "parse_blend"]


def normalized(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64, as Megatron normalises them (so the shares, and the
    choices made near a tie, are the same as Megatron's)."""
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def parse_blend(blend: Sequence, key: str = "data.blend") -> tuple[list[float], list[str]]:
    """Megatron's order, [w1, prefix1, w2, prefix2, ...] (a lone prefix is weight 1), as (weights, prefixes)."""
    try:
        return blend_spec.parse_blend(blend, key)
    except ValueError as err:
        raise DataError(str(err)) from None


@dataclass(frozen=True)
class Stage:
    """Weights in force from `start_step` on (until the next stage)."""

    start_step: int
    weights: tuple[float, ...]  # normalised

    @classmethod
    def of(cls, start_step: int, weights: Sequence[float]) -> Stage:
        """The stage of these weights, normalised as Megatron normalises them."""
        return cls(int(start_step), tuple(normalized(weights)))


@dataclass
class BlendCursor:
    """Where the greedy walk stands: before position `position`, each source has given `taken`
    samples in all, `stage_taken` of them in stage `stage`."""

    position: int
    taken: list[int]
    stage_taken: list[int]
    stage: int = 0

    @classmethod
    def start(cls, sources: int) -> BlendCursor:
        return cls(0, [0] * sources, [0] * sources, 0)

    def state_dict(self) -> dict:
        return {"position": self.position, "taken": list(self.taken), "stage_taken": list(self.stage_taken),
                "stage": self.stage}


def _pick(weights: Sequence[float], stage_taken: Sequence[int], i: int) -> int:
    """Megatron's rule: the source with the largest weight * max(i, 1) - taken, ties to the first."""
    scale = float(max(i, 1))
    best, best_error = 0, weights[0] * scale - stage_taken[0]
    for source in range(1, len(weights)):
        error = weights[source] * scale - stage_taken[source]
        if error > best_error:
            best, best_error = source, error
    return best


# From this many sources on, a pick is one numpy expression instead of a loop over the sources:
# per 1,024 positions, 2.1 ms at any count against 2.8 ms of the loop at 16 and 14.5 ms at 100
# (0.8 ms at 2), one thread of this host (BENCHMARKS.md). A blend that lists each shard as a source
# walks every step on every rank.
_ARRAY_PICK_SOURCES = 16


class _ArrayPick:
    """_pick's rule as one numpy expression, for one stage: the stage's counts kept as a float64 array
    (exact below 2^53) beside the cursor's list, so weight * max(i, 1) - taken is the same double
    arithmetic, and argmax takes the first of equals as _pick does. Called as _pick is; it counts
    the pick it returns."""

    def __init__(self, weights: Sequence[float], stage_taken: Sequence[int]) -> None:
        self.weight = np.asarray(weights, dtype=np.float64)
        self.taken = np.asarray(stage_taken, dtype=np.float64)

    def __call__(self, weights: Sequence[float], stage_taken: Sequence[int], i: int) -> int:
        source = int((self.weight * float(max(i, 1)) - self.taken).argmax())
        self.taken[source] += 1
        return source


class BlendedSamples:
    """Samples drawn from several SampleSets by weight; the interface of SampleSet that the data
    path uses (step_indices, ordered, batch, len)."""

    def __init__(self, sources: Sequence[SampleSet], stages: Sequence[Stage], names: Sequence[str],
                 shuffle: bool = True, orders: EpochOrders = IN_MEMORY) -> None:
        """`stages[0].start_step` must be 0; `names` label the sources in metrics; orders: where the
        sources' epoch orders come from (default: this process's memory)."""
        self.orders = orders
        if not stages or stages[0].start_step != 0:
            raise DataError("data.blend_schedule: the first stage must start at step 0")
        if any(len(stage.weights) != len(sources) for stage in stages):
            raise DataError(f"data.blend_schedule: every stage needs {len(sources)} weights, one per data.blend source")
        self.sources, self.stages, self.names, self.shuffle = list(sources), list(stages), list(names), shuffle
        self.seq_length = self.sources[0].seq_length
        self._cursor = BlendCursor.start(len(sources))
        # the evaluation order (ordered()): walked once, extended as later positions are asked for
        self._eval_cursor = BlendCursor.start(len(sources))
        self._eval_picks = np.empty((0, 2), dtype=np.int64)
        # each source's epoch orders in use: {source: {(seed, epoch): permutation}}, at most two.
        # epoch_orders.epoch_permutation's process-wide cache holds 16, and a step walks every source in
        # turn: with more sources than that (a blend that lists each shard) every source's order
        # was rebuilt on every step, on every rank
        self._orders: dict[int, dict[tuple[int, int], np.ndarray]] = {}

    def __len__(self) -> int:
        """Samples in one pass over every source (what an epoch of the blend would hold)."""
        return sum(len(source) for source in self.sources)

    def data_changes(self) -> tuple[int, ...]:
        """The steps after which the weights change: a stage starting at data step S (0-based, the
        batch of logged step S + 1) follows logged step S."""
        return tuple(stage.start_step for stage in self.stages[1:])

    def samples_before_a_repeat(self) -> int:
        """About how many positions the evaluation order (the first stage's weights) takes before a
        source repeats a sample: the smallest len / weight (the walk keeps each source within one
        sample of its share). Fewer than len(self) unless the weights follow the sizes."""
        weights = self.stages[0].weights
        return min(int(len(source) / weight) for source, weight in zip(self.sources, weights) if weight > 0)

    # ---- the greedy walk ----------------------------------------------------------------------
    def _stage_at(self, step: int) -> int:
        return max(index for index, stage in enumerate(self.stages) if stage.start_step <= step)

    def _walk(self, cursor: BlendCursor, end: int, global_batch_size: int,
              record: Optional[np.ndarray] = None) -> BlendCursor:
        """Advance `cursor` (in place) to position `end`, writing (source, ordinal) of each position
        passed into `record` when given."""
        while cursor.position < end:
            stage = self._stage_at(cursor.position // global_batch_size)
            if stage != cursor.stage:  # a new stage: its deficits start afresh
                cursor.stage, cursor.stage_taken = stage, [0] * len(self.sources)
            stage_start = self.stages[stage].start_step * global_batch_size
            stop = end if stage + 1 == len(self.stages) else min(end, self.stages[stage + 1].start_step * global_batch_size)
            weights = self.stages[stage].weights
            pick = _ArrayPick(weights, cursor.stage_taken) if len(weights) >= _ARRAY_PICK_SOURCES else _pick
            for position in range(cursor.position, stop):
                source = pick(weights, cursor.stage_taken, position - stage_start)
                if record is not None:
                    record[position - (end - len(record))] = (source, cursor.taken[source])
                cursor.taken[source] += 1
                cursor.stage_taken[source] += 1
            cursor.position = stop
        return cursor

    def cursor_at(self, position: int, global_batch_size: int) -> BlendCursor:
        """The walk's state before `position`; walks on from the kept cursor when it is not past it."""
        if self._cursor.position > position:
            self._cursor = BlendCursor.start(len(self.sources))
        return BlendCursor(**self._walk(self._cursor, position, global_batch_size).state_dict())

    def restore(self, state: dict) -> None:
        """Take the cursor a checkpoint stored (BlendCursor.state_dict())."""
        if len(state.get("taken", ())) != len(self.sources):
            raise DataError(f"the checkpoint's blend cursor has {len(state.get('taken', ()))} sources, "
                            f"data.blend has {len(self.sources)}")
        self._cursor = BlendCursor(int(state["position"]), [int(v) for v in state["taken"]],
                                   [int(v) for v in state["stage_taken"]], int(state.get("stage", 0)))

    # ---- the SampleSet interface ----------------------------------------------------------------
    def step_indices(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """(source, sample index) of each of the step's `global_batch_size` samples, in order."""
        start = step * global_batch_size
        self.cursor_at(start, global_batch_size)
        picks = np.empty((global_batch_size, 2), dtype=np.int64)
        self._walk(self._cursor, start + global_batch_size, global_batch_size, record=picks)
        return self._sample_indices(picks, seed if self.shuffle else None)

    def _sample_indices(self, picks: np.ndarray, seed: Optional[int]) -> np.ndarray:
        """(source, ordinal) rows -> (source, sample index): ordinal n of a source is sample n mod N,
        in the order of its epoch n // N (seeded by (seed, source, epoch); in order when seed is None)."""
        for source in np.unique(picks[:, 0]):
            rows = np.flatnonzero(picks[:, 0] == source)
            count = len(self.sources[source])
            epochs, offsets = np.divmod(picks[rows, 1], count)
            if seed is None:
                picks[rows, 1] = offsets
                continue
            for epoch in np.unique(epochs):
                these = epochs == epoch
                picks[rows[these], 1] = self._order(seed, int(source), int(epoch), count)[offsets[these]]
                # shared orders build the next epoch's ahead
                self.orders.reached(seed, int(epoch), count, 1 + int(source), int(offsets[these].max()) + 1)
        return picks

    def _order(self, seed: int, source: int, epoch: int, count: int) -> np.ndarray:
        """Source `source`'s sample order in its epoch `epoch`, kept while it is one of the source's two
        newest (a step reaches into at most the next epoch of a source)."""
        kept = self._orders.setdefault(source, {})
        if (seed, epoch) not in kept:
            for old in sorted(kept, key=lambda key: key[1])[:-1]:
                del kept[old]
            kept[seed, epoch] = self.orders(seed, epoch, count, stream=1 + source)
        return kept[seed, epoch]

    def ordered(self, positions: np.ndarray) -> np.ndarray:
        """(source, sample index) of blend positions in order, unshuffled, with the first stage's
        weights: the evaluation set."""
        end = int(positions.max()) + 1 if len(positions) else 0
        if end > len(self._eval_picks):  # walk on from where the last evaluation stopped
            more = np.empty((end - len(self._eval_picks), 2), dtype=np.int64)
            first_stage = BlendedSamples(self.sources, self.stages[:1], self.names)
            first_stage._walk(self._eval_cursor, end, 1, record=more)
            self._eval_picks = np.concatenate([self._eval_picks, self._sample_indices(more, None)])
        return self._eval_picks[positions]

    def batch(self, picks: np.ndarray, positions: Optional[np.ndarray] = None, unlearned_after: Optional[int] = None,
              check: bool = True):
        """(inputs, targets) of (source, sample index) rows, as SampleSet.batch."""
        if check:
            self.check_files(picks)
        return windows_batch([self.sources[int(s)][int(i)] for s, i in picks], positions, unlearned_after)

    def check_files(self, picks: Optional[np.ndarray] = None) -> None:
        """DataError when the files of a source `picks` reads (default: any source) shrank since they
        were opened (data/mapped.py): a blend of many shards stats only those a step samples."""
        sources = range(len(self.sources)) if picks is None else np.unique(picks[:, 0]) if len(picks) else ()
        for source in sources:
            self.sources[int(source)].check_files()

    def consumed_tokens(self, step: int, global_batch_size: int) -> dict[str, int]:
        """Tokens trained on from each source over steps [0, step) (seq_length per sample)."""
        cursor = self.cursor_at(step * global_batch_size, global_batch_size)
        return {name: taken * self.seq_length for name, taken in zip(self.names, cursor.taken)}
