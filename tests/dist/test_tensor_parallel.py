"""Tensor (and sequence) parallelism reproduces the tp=1 single-rank run: real gloo ranks, real
DeepSpeed engines, fp32, 12 steps, rtol 1e-5 on every logged loss and gradient norm."""
from __future__ import annotations

import pytest

from tests.support.composed import composes_runs
from tests.support.helpers import TINY, read_metrics
from tests.support.parity import FLAVOURS, assert_parity, train_runs as _train
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=12", "train.eval_interval=6"]


def _args(flavour: str, *extra: str) -> list[str]:
    return [*FLAVOURS[flavour], *TINY, *STEPS, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[dict]]:
    """tp=1, one rank, for each flavour."""
    dirs = reference_runs({f: _args(f) for f in FLAVOURS}, tmp_path_factory.mktemp("tp1"))
    return {f: read_metrics(dirs[f]) for f in FLAVOURS}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_rank(tp, reference, tmp_path):
    # SP at tp=4 is the tp=2 code with four ranks: only tp=2 runs it, for CI's time
    cases = [(f, sp) for f in FLAVOURS for sp in ((False, True) if tp == 2 else (False,))]
    runs = [(_args(f, f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}"),
             str(tmp_path / f"{f}-sp{int(sp)}")) for f, sp in cases]
    run_ranks(_train, tp, tmp_path, runs=runs)
    for (f, sp), (_, run_dir) in zip(cases, runs):
        assert_parity(read_metrics(run_dir), reference[f], f"{f} tp={tp} sp={sp}")


def test_tp2_dp2_zero_stages_match_single_rank(reference, tmp_path):
    """Sequence parallelism at ZeRO-1 sums replicated gradients in one bucket per step
    (parallel/grad_bucket.py), at ZeRO-2 at each use (DeepSpeed reduces inside backward); ZeRO-3
    partitions TP shards. Each case is a distinct path (four ranks on CI's two cores cost about a
    minute a run): ZeRO-1/2 without SP are the dp-only paths of tests/dist/test_zero.py under the
    TP layers that test_tp_matches_single_rank checks."""
    cases = [("gpt2", 0, False), ("gpt2", 3, False), ("gpt2", 1, True), ("llama", 2, True)]
    runs = [(_args(f, "parallel.tp=2", "parallel.dp=2", f"zero=stage{stage}", f"parallel.sequence_parallel={str(sp).lower()}"),
             str(tmp_path / f"{f}-z{stage}-sp{int(sp)}")) for f, stage, sp in cases]
    run_ranks(_train, 4, tmp_path, runs=runs)
    for (f, stage, sp), (_, run_dir) in zip(cases, runs):
        assert_parity(read_metrics(run_dir), reference[f], f"{f} tp=2 dp=2 zero={stage} sp={sp}")


@composes_runs
def _train_compiled(rank: int, world: int, runs: list) -> None:
    from torch._dynamo.utils import counters

    counters.clear()  # a forked rank inherits the parent's counts
    _train(rank, world, runs)
    assert counters["stats"]["unique_graphs"] > 0, f"rank {rank}: train.compile=true compiled nothing"


def test_compiled_blocks_under_tp2_sp_match_single_rank(reference, tmp_path):
    """train.compile=true with TP and SP: the collectives break the graph and run eagerly, the rest of
    each block is compiled by inductor; the numbers stay those of the eager single rank."""
    # One flavour: each costs a cold inductor compile on every rank (1-2 min on CI's 2 cores). gpt2 here
    # (row-parallel biases and LayerNorm gains summed over SP ranks); llama's compiled blocks are held
    # to eager in tests/unit/model/test_compile.py.
    # and train.compile_scope=model: the whole forward as one graph, at dp=2 ZeRO-1 (its reduction is
    # DeepSpeed's, outside the graph), in the same two ranks
    runs = [(_args("gpt2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.compile=true"),
             str(tmp_path / "gpt2-compiled")),
            (_args("gpt2", "parallel.dp=2", "zero=stage1", "train.compile=true", "train.compile_scope=model"),
             str(tmp_path / "gpt2-compiled-model"))]
    run_ranks(_train_compiled, 2, tmp_path, runs=runs)
    assert_parity(read_metrics(runs[0][1]), reference["gpt2"], "gpt2 tp=2 sp compiled")
    assert_parity(read_metrics(runs[1][1]), reference["gpt2"], "gpt2 dp=2 compiled whole")
