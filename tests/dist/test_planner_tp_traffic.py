"""The planner's tensor-parallel traffic against the bytes the collectives move, on real gloo ranks.

As test_planner_dp_traffic.py: each rank counts its collectives over its tp group in the steps after
the first, as the bytes a ring sends, and the plan's TP bytes per rank and step must be within 10%.
The plan had counted the blocks alone, two all-reduces more per block with recomputation, and every
MoE block as a dense one: 20% under at tp=2, 2.5 times under with MoE, whose experts every TP rank
holds whole and sums the gradients of over TP (21 GiB of fp32 a rank for mixtral_8x7b). What a
recomputed forward runs is torch's non-reentrant checkpoint's: it stops after the last tensor the
backward needs, before the MLP's closing reduction. DeepSpeed's pipeline with tp > 1 and no SP: its
stages also all-gather what they receive over TP (pipe_partitioned; the plan had 17% too little on
its first stage). The pipeline's sends are counted too: the plan had two a micro-batch on every
stage (a first or last one sends one) and 1/tp of an activation from each TP rank (FSDP2's pipeline
sends it whole without SP). Not here: the MoE all-to-alls over ep."""
from __future__ import annotations

import pytest

from tests.support.helpers import TINY
from tests.support.ranks import run_ranks
from tests.support.traffic import sent_per_step

pytestmark = pytest.mark.slow

STEPS = 3  # the first builds and warms up; the two after it are counted
LAYOUTS = {
    # each rank against the plan of its pipeline's stage 0; DeepSpeed's pipeline slices activations and
    # gradients over TP and gathers them (not under SP, whose activations are slices already)
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2-pp2-sp": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    "fsdp2-tp2-pp2": (4, ["backend=fsdp2", "zero=stage2", "parallel.tp=2", "parallel.pp=2"]),
    "fsdp2-tp2-pp2-sp": (4, ["backend=fsdp2", "zero=stage2", "parallel.tp=2", "parallel.pp=2",
                             "parallel.sequence_parallel=true"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2-recompute": (2, ["parallel.tp=2", "parallel.activation_checkpointing=true"]),
    "tp2-sp-recompute": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                             "parallel.activation_checkpointing=true"]),
    "fsdp2-tp2-sp": (2, ["backend=fsdp2", "zero=stage2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2-ep2-moe": (4, ["model=moe_tiny", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2"]),
    "tp2-ep2-moe-recompute": (4, ["model=moe_tiny", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                                  "parallel.activation_checkpointing=true"]),
    "tp2-ep2-moe-sp": (4, ["model=moe_tiny", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                           "parallel.sequence_parallel=true"]),
    "tp2-ep2-moe-sp-recompute": (4, ["model=moe_tiny", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                                     "parallel.sequence_parallel=true", "parallel.activation_checkpointing=true"]),
    "fsdp2-tp2-ep2-moe": (4, ["backend=fsdp2", "zero=stage2", "model=moe_tiny", "parallel.tp=2", "parallel.dp=2",
                              "parallel.ep=2"]),
}


def _count_tp_traffic(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    sent, planned = sent_per_step(overrides, world, run_dir, STEPS,
                                  lambda layout: {"tp": layout.grid.group_of(rank, "tp")})
    return {"sent": sent["tp"], "planned": planned["tp"], "sent_pp": sent["send"], "planned_pp": planned["pp"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planned_tp_traffic_is_within_10_percent_of_what_the_ranks_send(layout, tmp_path):
    world, extra = LAYOUTS[layout]
    overrides = [*TINY, "parallel.global_batch_size=16", f"train.max_steps={STEPS}", "train.eval_interval=0", *extra]
    results = run_ranks(_count_tp_traffic, world, tmp_path, overrides=overrides, run_dir=str(tmp_path / "run"))
    for rank, r in enumerate(results):
        assert r["planned"] == pytest.approx(r["sent"], rel=0.10), (layout, rank, r)
        # the pipeline's sends: DeepSpeed's without SP and both under SP are 1/tp slices
        assert r["planned_pp"] == pytest.approx(r["sent_pp"], rel=0.10), (layout, rank, r)
