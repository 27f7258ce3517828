"""megaframe-plan --dry-run builds a pipeline rank's stages by its engine's own code: FSDP2's looped
and V schedules (several stages per rank, a tied embedding's copy on the last stage) as its engine
cuts them, held against the planner's count for that rank and against the whole model's size."""
from __future__ import annotations

import json

import pytest

from megaframe.config.compose import compose
from megaframe.model.dims import resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.plan.cli import main as plan_main
from megaframe.plan.dryrun import dry_run

SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule, v", SCHEDULES)
@pytest.mark.parametrize("model", ["gpt_tiny", "llama_tiny"])
def test_fsdp2_pipeline_ranks_hold_every_block_once(model, schedule, v):
    """Over the ranks of tp=2 x pp=2, each block is built on each tp rank exactly once, the ends
    (embedding, final norm, head) likewise, and the parameters add up to the unpipelined model's
    on both tp ranks (GPT itself, not the engine's cut), plus a tied embedding's last-stage copy of the token table)."""
    cfg, _ = compose([f"model={model}", "model.num_layers=8"])
    dims = resolve_dims(cfg.model, 4096, tp=2)
    grid = ParallelDims(tp=2, pp=2)
    built = [dry_run(dims, grid, rank, "uniform", "fsdp2", schedule, v) for rank in range(grid.world_size)]
    for tp_rank in range(2):
        mine = [b for b in built if b.tp_rank == tp_rank]
        layers = sorted(name for b in mine for name in b.layers)
        assert layers == sorted(["embed", *(f"block {i}" for i in range(8)), "final_norm",
                                 "head (tied embed)" if dims.tie_embeddings else "head"]), layers
        assert sorted(s for b in mine for s in b.stages) == list(range(2 * (v if v > 1 else 1)))
    whole = sum(dry_run(dims, ParallelDims(tp=2), rank).parameters for rank in range(2))
    copy = dims.padded_vocab_size * dims.hidden_size if dims.tie_embeddings else 0
    assert sum(b.parameters for b in built) == whole + copy


@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_the_cli_dry_run_of_an_fsdp2_pipeline_is_the_planners_count(schedule, v, capsys):
    """megaframe-plan's dry run of each pipeline rank (refused before: it followed DeepSpeed's
    partition alone) reports the stages that rank runs and the planner's count for them."""
    args = ["model=llama_tiny", "model.num_layers=8", "backend=fsdp2", "zero=stage2", "parallel.pp=2",
            f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={v}", "parallel.global_batch_size=32",
            "--json"]
    for rank in (0, 1):
        plan_main([*args, f"--dry-run={rank}"])
        dry = json.loads(capsys.readouterr().out)["dry_run"]
        assert dry["parameters"] == dry["planner_parameters"] > 0, dry
        assert len(dry["stages"]) == (1 if schedule == "1f1b" else 2), dry
