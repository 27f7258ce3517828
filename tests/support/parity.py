"""Shared by the parity tests: train configs inside a set of ranks, compare curves."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.support.composed import composes_runs
from tests.support.helpers import assert_ok, cli_env, curve, read_metrics, run_code
from tests.support.numerics import FACTOR, FP32_EPS

FLAVOURS = {"gpt2": ["model=gpt_tiny"], "llama": ["model=llama_tiny"]}  # llama_tiny: 2 kv heads (GQA)
# Why 1e-5 holds on any x86-64 host (fp32, 20 steps of the tiny models): a layout sums the same
# products in another order (TP splits the matmuls' inner dimension, DP and ZeRO add micro-batch
# gradients across ranks, PP sends activations unchanged), which moves each step's numbers by a
# few fp32 ulps (~1e-7 relative); AdamW's normalised update keeps that from growing much over 20
# steps (docs/architecture.md, "Numerics across hosts", has the worst deviations measured per capability). What used
# to depend on the host was our own ZeRO-0 gradient norm's fp32 accumulation: under AVX2 it was
# 1.19e-5 off DeepSpeed's fp64 ZeRO-3 norm (the NVMe test). It is fp64 now (training/trainer.py).
# MEGAFRAME_PARITY_REPORT=FILE appends each comparison's worst relative deviation to FILE.
RTOL = 1e-5
# The gradient norm is held to more than RTOL: issue 32 asked 1e-6 of it against the one-process
# run, and that cannot be met against the fp32 one: on pp2 with 4 llama layers the fp32 one-process
# norm is itself 1.64e-6 from the exact one at one step, where the cp2 ring's came within 2.2e-7 of
# exact (and 1.42e-6 of the fp32 run). So the norm is compared with the one-process run in float64
# (train_runs(fp64=True)), step by step, within tests/support/numerics.py's FACTOR times the fp32 rounding of
# that step: the larger distance from it of two fp32 one-process runs that sum in different orders
# (OTHER_ORDER), and at least one fp32 ulp. A bound from the arithmetic of the case at hand on this
# host, as issue 36 asks: 9.5e-7 at the steps where both fp32 runs round within an ulp, wider only
# at ill-conditioned steps (there RTOL's check may be the tighter one).
# Per step, not the worst over the curve: one ill-conditioned step would otherwise lend its
# allowance to every other step (BENCHMARKS.md has the measured ratios).
# The second fp32 reference runs with ATEN_CPU_CAPABILITY=default: torch's kernels without SIMD, the
# same arithmetic in another order. (A smaller micro-batch would change an MoE's load-balancing loss,
# which is per micro-batch, not only the order.)
OTHER_ORDER = {"ATEN_CPU_CAPABILITY": "default"}


# fp8 (and bf16 beside it) cannot be held to RTOL: a reordered fp32 sum moves a value across an fp8 or
# bf16 rounding boundary now and then (a step of 2^-4 or 2^-8 relative in that element), and training
# carries such flips forward. So issue 36's rule is taken whole-curve for fp8 (issue 53): a layout
# is within ORDER_FACTOR x the distance between two single-rank runs of the same config that sum in
# different orders (the second under OTHER_ORDER), per quantity (the losses with the eval losses; the
# gradient norm), as the worst relative distance over the logged steps. Whole-curve, not per step:
# at the first steps a reordering flips a handful of roundings or none (the two runs can agree to
# 1e-7 at step 1 by chance), and the divergence then grows with each step; the curve's worst is the
# scale the arithmetic allows. Measured on the 2-core AVX2 host (tests/dist/test_fp8_layouts.py:
# four recipes, eight layouts, four steps): the worst layout was 3.5x the two runs' distance (cp=2's
# gradient norm, tensorwise); with hidden 64 and six steps 5.8x (cp=2, rowwise_with_gw_hp). 16 leaves
# room for a host that orders its sums worse. It is no bound on fp8 against bf16: on the tiny models
# those curves are ~2x the reordering's distance apart, so test_fp8_layouts.py counts fp8 matmuls too.
ORDER_FACTOR = 16.0
ORDER_GROUPS = {"loss": ("loss", "eval_loss"), "grad_norm": ("grad_norm",)}

# A one-process run steps through the plain engine unless told not to (docs/engines.md)
DEEPSPEED_AT_ONE_RANK = ["backend.plain_one_process=false"]


def pretend_fp16_device() -> None:
    """Test-only: tell DeepSpeed's capability check that this CPU has fp16 (the arithmetic then runs on
    the CPU). validate()'s default fp16 rule asks the same accelerator, so it accepts fp16 too."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


@composes_runs
def train_runs(rank: int, world: int, runs: list[tuple[list[str], str]], fp16: bool = False,
               fp64: bool = False, engine: Optional[str] = None) -> list[float]:
    """Train each (overrides, run_dir) in turn inside these ranks (saves a process start per config);
    fp16=True runs them on a pretended fp16 device (pretend_fp16_device); fp64=True runs the model in
    float64 from the same initial values (one process only: the exact reference of the gradient
    norm, assert_norm_parity). engine: the engine that must step (deepspeed, fsdp2 or plain). Returns
    this rank's last gradient norm of each run (every rank computes the global one)."""
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer
    from tests.support.composed import composed

    if fp16:
        pretend_fp16_device()
    if fp64:
        _build_in_float64()
    norms = []
    for overrides, run_dir in runs:
        cfg = composed(overrides)  # composed once before the ranks were forked
        # the engine's rules too, as the launch asks them: a test never passes on a layout users are refused
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
            if fp64:  # the engine that steps built its model through the patched builder
                assert {p.dtype for p in trainer.backend.module.parameters()} == {torch.float64}, trainer.engine
            assert engine in (None, trainer.engine), f"{trainer.engine} stepped, not {engine}"
            trainer.fit()
            norms.append(trainer.backend.grad_norm())
    return norms


def _build_in_float64() -> None:
    """This process's one-process engine (the plain one) builds its model as usual, in fp32 (the
    initial values are those of the fp32 run), then casts it to float64; every tensor made after that
    defaults to float64 too. The forked rank process ends with its runs, so nothing is undone."""
    import megaframe.backends.plain.engine as plain

    build = plain.build_model

    def build_then_widen(*args, **kwargs):
        torch.set_default_dtype(torch.float32)
        try:
            return build(*args, **kwargs).double()
        finally:
            torch.set_default_dtype(torch.float64)

    plain.build_model = build_then_widen
    torch.set_default_dtype(torch.float64)


def assert_parity(got: list[dict], want: list[dict], what: str,
                  keys: tuple[str, ...] = ("loss", "grad_norm", "eval_loss"), rtol: float = RTOL,
                  order: Optional[list[dict]] = None, exact: Optional[list[dict]] = None) -> None:
    """Every logged value of `keys` (loss, gradient norm and eval loss) within rtol of the
    reference run's `want`, or, where the reference's own rounding at that step is larger, within
    FACTOR x that rounding. The rounding is measured, per step, by what is given: `order`, the same
    single-rank run summing in another order (train_other_order), and `exact`, the run in float64
    (exact_references), as the reference's distance from them. An ill-conditioned step moves by more
    than rtol under any reordering, the single-rank run's own included: at step 11 of the 4-block
    llama of test_pipeline_parallel.py, a loss spike's gradient norm differs by 2.5e-3 between two
    single-rank runs (ATEN_CPU_CAPABILITY avx512 and default), where dp=2 moved it by 4.4e-4; at
    step 8 of test_fsdp2_pipeline.py's MoE the fp32 reference's router loss is 1.1e-5 from the
    float64 run's, and the dp2 x ep2 layouts 1.3e-8. Elsewhere the allowance stays rtol."""
    for key in keys:
        g, w = curve(got, key), curve(want, key)
        assert [s for s, _ in g] == [s for s, _ in w] and len(w) >= 2, f"{what}: {key} steps differ"
        own = {step: 0.0 for step, _ in w}
        for other in (order, exact):
            o = curve(other, key) if other else []
            assert not other or [s for s, _ in o] == [s for s, _ in w], f"{what}: {key} steps of a rounding run differ"
            for (step, v), (_, b) in zip(o, w):
                own[step] = max(own[step], abs(v - b) / abs(b) if b else 0.0)
        _report(what, key, max(abs(a - b) / abs(b) if b else abs(a) for (_, a), (_, b) in zip(g, w)))
        for (step, a), (_, b) in zip(g, w):
            allowed = max(rtol, FACTOR * own[step])
            assert a == pytest.approx(b, rel=allowed), (f"{what}: {key} at step {step}: {a} vs reference {b} (allowed "
                                                        f"{allowed:.3g}: rtol, or {FACTOR:g}x the reference's own "
                                                        f"rounding there, {own[step]:.3g})")


def assert_norm_parity(got: list[dict], fp32_runs: list[list[dict]], want64: list[dict], what: str) -> None:
    """Each logged gradient norm of `got` within FACTOR x that step's fp32 rounding of the fp64
    reference's norm: the fp32 references' largest relative distance from it (at least one fp32 ulp)."""
    g, w64, *w32 = (curve(records, "grad_norm") for records in (got, want64, *fp32_runs))
    steps = [s for s, _ in w64]
    assert len(steps) >= 2 and w32 and all([s for s, _ in c] == steps for c in (g, *w32)), f"{what}: steps differ"
    worst_ratio, worst = 0.0, (0, 0.0, 0.0)
    for k, (step, exact) in enumerate(w64):
        own = max(FP32_EPS, *(abs(c[k][1] - exact) / exact for c in w32))
        off = abs(g[k][1] - exact) / exact
        if off / own >= worst_ratio:
            worst_ratio, worst = off / own, (step, off, own)
    step, off, own = worst
    _report(what, "grad_norm/fp64", off, own)
    assert worst_ratio <= FACTOR, (f"{what}: gradient norm at step {step} {off:.3g} (relative) from the fp64 "
                                   f"reference's, over {FACTOR:g}x the fp32 references' own {own:.3g}")


def curve_distance(got: list[dict], want: list[dict], keys: tuple[str, ...], what: str) -> float:
    """The worst relative distance of `got`'s logged values of `keys` from `want`'s, over the steps."""
    worst = 0.0
    for key in keys:
        g, w = curve(got, key), curve(want, key)
        assert [s for s, _ in g] == [s for s, _ in w] and len(w) >= 1, f"{what}: {key} steps differ"
        worst = max([worst, *(abs(a - b) / abs(b) if b else abs(a) for (_, a), (_, b) in zip(g, w))])
    return worst


def assert_within_order(got: list[dict], reference: list[dict], other_order: list[dict], what: str,
                        factor: float = ORDER_FACTOR) -> None:
    """`got` follows the single-rank `reference` curve within factor x the distance between it and
    `other_order` (the same run summing in another order: train_other_order), per ORDER_GROUPS
    quantity, over the whole curve (at least one fp32 ulp: two runs that happen to agree give no scale)."""
    for name, keys in ORDER_GROUPS.items():
        own = max(FP32_EPS, curve_distance(other_order, reference, keys, f"{what} (other order)"))
        off = curve_distance(got, reference, keys, what)
        _report(what, f"{name}/order", off, own)
        assert off <= factor * own, (f"{what}: {name} {off:.3g} (relative) from the single-rank run, over "
                                     f"{factor:g}x the distance of the same run summing in another order ({own:.3g})")


def exact_references(root: Path, flavours: dict[str, list[str]]) -> dict[str, Path]:
    """The references of each flavour's run (name -> overrides) at one rank: NAME, DeepSpeed's engine
    in fp32; NAME-order, the same summing in another order (the one-process run, in a new interpreter
    under OTHER_ORDER: train_other_order); NAME-fp64, the plain engine in float64 from the same initial values. Returns their
    run directories by name. NAME and NAME-fp64 come from the session's reference cache
    (reference_cache.py); NAME-order measures this host's rounding and runs every time."""
    from tests.support.reference_cache import reference_runs

    found = reference_runs({name: [*overrides, *DEEPSPEED_AT_ONE_RANK] for name, overrides in flavours.items()}, root,
                           engine="deepspeed")
    found.update(reference_runs({f"{name}-fp64": overrides for name, overrides in flavours.items()}, root,
                                fp64=True, engine="plain"))
    order = {f"{name}-order": root / f"{name}-order" for name in flavours}
    train_other_order([(overrides, order[f"{name}-order"]) for name, overrides in flavours.items()], root)
    return {**found, **order}


# Trains (overrides, run_dir) pairs as reference_runs does (train_runs in one rank), in this new
# interpreter: torch reads ATEN_CPU_CAPABILITY once, at its first kernel
_OTHER_ORDER_RUNS = """
import json, sys
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks
run_ranks(train_runs, 1, sys.argv[2], runs=[tuple(run) for run in json.loads(sys.argv[1])])
"""


def train_other_order(runs: list[tuple[list[str], Path]], root: Path) -> None:
    """Each one-process run (overrides, run_dir) under OTHER_ORDER: one new interpreter for them all
    (the capability is read at import; one interpreter per run paid its imports each time)."""
    work = root / "other-order-ranks"
    work.mkdir(parents=True, exist_ok=True)
    assert_ok(run_code(_OTHER_ORDER_RUNS, [json.dumps([(list(o), str(d)) for o, d in runs]), str(work)],
                       env={**cli_env(), **OTHER_ORDER}))


def assert_exact_norm(run_dir: Path, references: dict[str, Path], flavour: str, what: str) -> None:
    """assert_norm_parity of the run in run_dir against exact_references' runs of `flavour`."""
    assert_norm_parity(read_metrics(run_dir), [read_metrics(references[flavour]), read_metrics(references[f"{flavour}-order"])],
                       read_metrics(references[f"{flavour}-fp64"]), what)


def assert_deepspeed_continues(saved: Path, overrides: list[str], reference: list[dict], tmp_path: Path,
                               what: str) -> None:
    """A checkpoint saved at step k (in any layout, by either engine) resumed by DeepSpeed's engine at
    one rank with `overrides` (not the plain engine a one-process run gets by default): its records
    start at step k+1 and, after the reference's first k, are the reference run's curve."""
    from tests.support.ranks import run_ranks

    step = int(saved.name.removeprefix("global_step"))
    run_ranks(train_runs, 1, tmp_path, runs=[([*overrides, *DEEPSPEED_AT_ONE_RANK, f"train.resume={saved}"],
                                              str(tmp_path / "deepspeed-resumed"))], engine="deepspeed")
    resumed = read_metrics(tmp_path / "deepspeed-resumed")
    assert min(r["step"] for r in resumed) == step + 1
    assert_parity([r for r in reference if r["step"] <= step] + resumed, reference, what)


def _report(what: str, key: str, worst: float, own: float = 0.0) -> None:
    path = os.environ.get("MEGAFRAME_PARITY_REPORT")
    if path:
        with open(path, "a") as f:  # one short line per write: safe from concurrent test processes
            f.write(json.dumps({"what": what, "key": key, "worst_rel": worst, **({"own_rel": own} if own else {})}) + "\n")
