"""Mixture-of-Experts through the Trainer on real gloo ranks reproduces the single-rank run of
`model=moe_tiny`: fp32, 12 steps, every logged loss, gradient norm and eval loss within rtol 1e-5
(tests/support/parity.py), with experts split over ep ranks (all-to-all dispatch, expert gradients reduced
over the expert-data-parallel ranks) next to DP with ZeRO 0-3, TP (with and without SP), CP, PP,
activation checkpointing, compile and aux-loss-free bias balancing. The router metrics (aux and z losses, expert load) agree as well.

Capacity mode (model.moe.capacity_factor) drops assignments by each rank's own tokens, so it
matches the single rank where a rank's micro-batch tokens are the single rank's: under dp and
ep, not under tp or cp (which split a micro-batch's tokens); that is the case tested."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.support.parity import assert_parity, train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

pytestmark = pytest.mark.slow
MODEL = ["model=moe_tiny", "train.max_steps=12", "train.eval_interval=6"]
CAPACITY = ["model.moe.capacity_factor=1.0"]
BIAS = ["model.moe.bias_update_rate=0.001"]  # aux-loss-free balancing, next to the aux loss
ROUTER_KEYS = ("moe/aux_loss", "moe/z_loss", "moe/max_load")


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    variants = {"dropless": [], "capacity": CAPACITY, "bias": BIAS}
    dirs = reference_runs({name: [*TINY, *MODEL, *extra] for name, extra in variants.items()},
                          tmp_path_factory.mktemp("single"))
    return {name: read_metrics(dirs[name]) for name in variants}


CASES_2 = {"dropless-dp2-ep2": ["parallel.dp=2", "parallel.ep=2"],
           "dropless-cp2-ep2": ["parallel.cp=2", "parallel.ep=2"],
           "dropless-dp2-ep2-recompute": ["parallel.dp=2", "parallel.ep=2", "parallel.activation_checkpointing=true"],
           "dropless-dp2-ep2-compiled": ["parallel.dp=2", "parallel.ep=2", "train.compile=true"],
           "capacity-dp2-ep2": ["parallel.dp=2", "parallel.ep=2", *CAPACITY],
           "dropless-dp2-zero3": ["parallel.dp=2", "zero=stage3"],  # ep=1: experts partitioned like dense weights
           "dropless-dp2-ep2-zero3": ["parallel.dp=2", "parallel.ep=2", "zero=stage3"],
           "dropless-dp2-ep2-zero3-offload": ["parallel.dp=2", "parallel.ep=2", "zero=stage3", "offload=cpu",
                                              "offload.param=cpu"]}
CASES_4 = {"dropless-dp4-ep2": ["parallel.dp=4", "parallel.ep=2"],  # ZeRO-0: expert gradients all-reduced over edp=2
           "dropless-dp4-ep2-zero1": ["parallel.dp=4", "parallel.ep=2", "zero=stage1"],
           "dropless-dp4-ep2-zero2": ["parallel.dp=4", "parallel.ep=2", "zero=stage2"],
           "dropless-dp4-ep4-zero1": ["parallel.dp=4", "parallel.ep=4", "zero=stage1"],
           # ZeRO-3 partitions each rank's experts over their 2 expert-data-parallel replicas
           "dropless-dp4-ep2-zero3": ["parallel.dp=4", "parallel.ep=2", "zero=stage3"],
           "dropless-tp2-ep2-zero3": ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "zero=stage3"],
           "dropless-cp2-dp2-ep4-zero3": ["parallel.cp=2", "parallel.dp=2", "parallel.ep=4", "zero=stage3"],
           "dropless-tp2-ep2": ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2"],
           "dropless-tp2-sp-ep2-zero1": ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                                         "parallel.sequence_parallel=true", "zero=stage1"],
           "capacity-dp4-ep4-zero2": ["parallel.dp=4", "parallel.ep=4", "zero=stage2", *CAPACITY],
           "dropless-pp2-dp2-ep2": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"],
           "bias-pp2-dp2-ep2-zero1": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "zero=stage1", *BIAS]}


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["world2", "world4"])
def test_expert_parallel_layouts_match_single_rank(references, world, cases, tmp_path, deepspeed_ops):
    runs = [([*TINY, *MODEL, *extra], str(tmp_path / name)) for name, extra in cases.items()]
    deepspeed_ops(*(overrides for overrides, _ in runs))
    run_ranks(train_runs, world, tmp_path, timeout=1200, runs=runs)
    for _, run_dir in runs:
        name = Path(run_dir).name
        reference = references[name.split("-", 1)[0]]
        got = read_metrics(run_dir)
        assert_parity(got, reference, name)
        assert_parity(got, reference, name, keys=ROUTER_KEYS)
        if name.startswith("capacity"):
            dropped = [r["moe/dropped_fraction"] for r in got if "moe/dropped_fraction" in r]
            assert max(dropped) > 0, f"{name}: capacity 1.0 should drop some assignments of an untrained router"
            assert_parity(got, reference, name, keys=("moe/dropped_fraction",))
