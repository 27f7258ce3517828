"""Context parallelism through the Trainer on real gloo ranks reproduces the single-rank run: fp32,
12 steps, every logged loss, gradient norm and eval loss within rtol 1e-5 (tests/support/parity.py), for
both model flavours (Llama with grouped-query attention)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.support.parity import FLAVOURS, assert_parity, train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=12", "train.eval_interval=6"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    dirs = reference_runs({f: [*TINY, *FLAVOURS[f], *STEPS] for f in FLAVOURS}, tmp_path_factory.mktemp("single"))
    return {f: read_metrics(dirs[f]) for f in FLAVOURS}


CASES_2 = {"cp2-ring": ["parallel.cp=2"], "cp2-ulysses": ["parallel.cp=2", "parallel.cp_impl=ulysses"],
           "cp2-ring-compiled": ["parallel.cp=2", "train.compile=true"]}
CASES_4 = {"cp4-ring": ["parallel.cp=4"], "cp2-dp2-zero3": ["parallel.cp=2", "parallel.dp=2", "zero=stage3"],
           "tp2-cp2-sp": ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"],
           "pp2-cp2": ["parallel.pp=2", "parallel.cp=2"],
           "cp2-dp2-zero1-recompute": ["parallel.cp=2", "parallel.dp=2", "zero=stage1",
                                       "parallel.activation_checkpointing=true"]}


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["world2", "world4"])
def test_context_parallel_layouts_match_single_rank(references, world, cases, tmp_path):
    # compiled: Llama only (grouped-query attention and RoPE in the graph); GPT-2 goes through the same ring code
    runs = [([*TINY, *FLAVOURS[f], *STEPS, *extra], str(tmp_path / f"{f}-{name}"))
            for f in FLAVOURS for name, extra in cases.items() if not (f == "gpt2" and name.endswith("compiled"))]
    run_ranks(train_runs, world, tmp_path, timeout=1200, runs=runs)
    for overrides, run_dir in runs:
        flavour = Path(run_dir).name.split("-", 1)[0]
        assert_parity(read_metrics(run_dir), references[flavour], Path(run_dir).name)
