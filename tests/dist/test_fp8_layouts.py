"""fp8 is layout-invariant: each recipe (tensorwise, rowwise, rowwise_with_gw_hp, mxfp8; emulated, as
the CPU runs them) at tp=2 with sequence parallelism, tp=4, pp=2, dp=2 under ZeRO-1 and ZeRO-3,
FSDP2 at dp=2, cp=2, and the MoE model at ep=2 (MXFP8's experts through the grouped GEMM) follows
the fp8 single-rank curve within issue 36's rule taken whole-curve (tests/support/parity.py:
assert_within_order): ORDER_FACTOR x the distance between two single-rank fp8 runs that sum in
different orders.

The single-rank run is DeepSpeed's engine at ZeRO-1, as the layouts here step. bf16 (and so fp8) at
ZeRO-0, a one-process run's default, used to land on another curve (1.2% from fp32's after four
steps): DeepSpeed's FP16_UnfusedOptimizer steps AdamW once on zero gradients when it is built.
megaframe undoes that step (megaframe/backends/deepspeed/build_step.py), and ZeRO-0 now follows
ZeRO-1's curve (tests/dist/test_zero0_build_step.py).

The bound alone cannot tell fp8 from bf16 on a model this small (fp8's own distance from the bf16
run is ~2x the reordering's over six steps), so each run also counts the matmuls its fp8 recipe took
on every rank (linears; MXFP8's grouped expert GEMMs): a layout's ranks together take what the
single-rank run takes times tp x cp (each TP or CP rank runs every linear of its stage on its own
piece), so a stage, a wrapped module or a recompute that fell back to bf16 shows. Dropping the TP
amax reduction is shown to break tp=2 in tests/dist/test_fp8_tp.py, where the arithmetic is exact
(end to end its effect is of the reordering's size on this model: 2x it).

Muon with fp8 (tensorwise: optim=muon orthogonalises the fp32 masters of the fp8 linears' weights)
follows the single-rank fp8 Muon curve by the same rule at dp=2 under ZeRO-1 (each rank assembling the
matrices it owns from DeepSpeed's flat partitions) and under FSDP2 at tp=2 (each TP piece assembled on
one rank), in the same set of ranks as the AdamW layouts.

Dense runs use hidden 128, the smallest MXFP8 allows at tp=4 (each rank's reduction dimension a
multiple of 32). One set of ranks per world size; the references once per module."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.support.composed import composes_runs
from tests.support.helpers import TINY, read_metrics
from tests.support.parity import DEEPSPEED_AT_ONE_RANK, assert_within_order, train_other_order, train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

pytestmark = pytest.mark.slow
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
STEPS = ["train.max_steps=4", "train.eval_interval=2"]
MODELS = {"dense": [*TINY, "model.hidden_size=128"], "moe": [*TINY, "model=moe_tiny"]}
SINGLE = ["zero=stage1", *DEEPSPEED_AT_ONE_RANK]
# name -> (model, overrides, tp x cp: how many ranks run each linear on their own piece)
LAYOUTS_2 = {"tp2-sp": ("dense", ["zero=stage1", "parallel.tp=2", "parallel.sequence_parallel=true"], 2),
             "pp2": ("dense", ["zero=stage1", "parallel.pp=2"], 1),
             "dp2-zero1": ("dense", ["zero=stage1", "parallel.dp=2"], 1),
             "dp2-zero3": ("dense", ["zero=stage3", "parallel.dp=2"], 1),
             "fsdp2-dp2": ("dense", ["backend=fsdp2", "zero=stage3", "parallel.dp=2"], 1),
             "cp2": ("dense", ["zero=stage1", "parallel.cp=2"], 2),
             "ep2": ("moe", ["zero=stage1", "parallel.dp=2", "parallel.ep=2"], 1)}
LAYOUTS_4 = {"tp4": ("dense", ["zero=stage1", "parallel.tp=4"], 4)}
# fp8 under Muon: (layout overrides, tp x cp), tensorwise, against the single-rank fp8 Muon run
MUON = ["optim=muon"]
MUON_RECIPE = "tensorwise"
MUON_LAYOUTS_2 = {"muon-dp2-zero1": (["zero=stage1", "parallel.dp=2"], 1),
                  "muon-fsdp2-tp2": (["backend=fsdp2", "zero=stage3", "parallel.tp=2"], 2)}
CALLS = "fp8_calls-rank{rank}.json"


def _fp8(model: str, recipe: str) -> list[str]:
    return [*MODELS[model], *STEPS, "precision=fp8", f"precision.fp8.recipe={recipe}"]


@composes_runs
def train_counting(rank: int, world: int, runs: list[tuple[list[str], str]], **kwargs) -> list[float]:
    """parity.train_runs, counting the matmuls the fp8 recipe took on this rank (linears, forward;
    MXFP8's grouped expert GEMMs) into CALLS in each run's folder."""
    from megaframe.parallel.fp8.base import Fp8Recipe
    from megaframe.parallel.fp8.mx import MXRecipe

    calls: Counter = Counter()
    linear, grouped = Fp8Recipe.linear, MXRecipe.grouped_mm

    def counted_linear(self, x, weight, bias, site):
        calls["linear"] += self.takes(site)
        return linear(self, x, weight, bias, site)

    def counted_grouped(self, x, weight, offsets, site):
        calls["grouped"] += 1
        return grouped(self, x, weight, offsets, site)

    Fp8Recipe.linear, MXRecipe.grouped_mm = counted_linear, counted_grouped  # this forked rank only
    norms = []
    for overrides, run_dir in runs:
        calls.clear()
        norms += train_runs(rank, world, [(overrides, run_dir)], **kwargs)
        (Path(run_dir) / CALLS.format(rank=rank)).write_text(json.dumps(dict(calls)))
    return norms


def _calls(run_dir: Path) -> list[Counter]:
    return [Counter(json.loads(p.read_text())) for p in sorted(run_dir.glob(CALLS.format(rank="*")))]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each model and recipe at one rank (DeepSpeed, ZeRO-1): the run (session-cached) and the same
    run summing in another order (parity.OTHER_ORDER, one fresh interpreter for all)."""
    root = tmp_path_factory.mktemp("fp8-single")
    runs = {f"{model}-{recipe}": [*_fp8(model, recipe), *SINGLE] for model in MODELS for recipe in RECIPES}
    runs["dense-muon"] = [*_fp8("dense", MUON_RECIPE), *MUON, *SINGLE]
    found = reference_runs(runs, root, train=train_counting, engine="deepspeed")
    order = {name: root / f"{name}-order" for name in runs}
    train_other_order([(runs[name], order[name]) for name in runs], root)
    return {name: (found[name], order[name]) for name in runs}


def _check(layouts: dict, world: int, references: dict, tmp_path: Path, muon: dict | None = None) -> None:
    runs = [([*_fp8(model, recipe), *extra], str(tmp_path / f"{name}-{recipe}"))
            for name, (model, extra, _) in layouts.items() for recipe in RECIPES]
    runs += [([*_fp8("dense", MUON_RECIPE), *MUON, *extra], str(tmp_path / name))
             for name, (extra, _) in (muon or {}).items()]
    run_ranks(train_counting, world, tmp_path, runs=runs)
    for name, (model, _, pieces) in layouts.items():
        for recipe in RECIPES:
            _check_run(f"fp8 {recipe} {name}", tmp_path / f"{name}-{recipe}", references[f"{model}-{recipe}"],
                       world, pieces, model == "moe" and recipe == "mxfp8")
    for name, (_, pieces) in (muon or {}).items():
        _check_run(f"fp8 {MUON_RECIPE} {name}", tmp_path / name, references["dense-muon"], world, pieces, False)


def _check_run(what: str, run: Path, reference: tuple[Path, Path], world: int, pieces: int, grouped: bool) -> None:
    single, other = reference
    assert_within_order(read_metrics(run), read_metrics(single), read_metrics(other), what)
    ranks, (alone,) = _calls(run), _calls(single)
    assert len(ranks) == world and all(r["linear"] for r in ranks), f"{what}: a rank took no fp8 linear: {ranks}"
    assert sum(ranks, Counter()) == Counter({k: pieces * n for k, n in alone.items()}), \
        f"{what}: fp8 matmuls per rank {ranks}, the single-rank run's {dict(alone)} x {pieces}"
    assert bool(alone["grouped"]) == grouped, f"{what}: {dict(alone)}"


def test_fp8_at_two_ranks_follows_the_single_rank_curve(references, tmp_path):
    _check(LAYOUTS_2, 2, references, tmp_path, muon=MUON_LAYOUTS_2)


def test_fp8_at_tp4_follows_the_single_rank_curve(references, tmp_path):
    _check(LAYOUTS_4, 4, references, tmp_path)
