"""Pipeline schedules as facts (parallel/pipeline_schedules.py) against torch's own schedules and
FSDP2's real stages: every micro-batch count megaframe accepts, torch's schedule constructs with
(and every one torch refuses, megaframe refuses first, in one line before launch); the planner's
parameters per pipeline rank are those of the stages FSDP2 builds for it."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from megaframe.parallel.pipeline_schedules import (SCHEDULES, bubble_fraction, runs_micro_batches, stage_indices,
                                                   stages_per_rank)

TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
         "zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def _torch_accepts(schedule: str, pp: int, v: int, m: int) -> bool:
    """Whether torch's schedule class constructs for m micro-batches, on mock stages of pipeline rank 0."""
    from torch.distributed.pipelining import PipelineStage, schedules

    per_rank = stages_per_rank(schedule, v)
    stages = []
    for _ in range(per_rank):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.num_stages, stage.submod = 0, pp, pp * per_rank, None
        stages.append(stage)
    cls = getattr(schedules, TORCH[schedule])
    try:
        cls(stages[0] if per_rank == 1 and schedule in ("gpipe", "1f1b") else stages, m, loss_fn=lambda a, b: a)
    except (ValueError, RuntimeError, AssertionError):
        return False
    return True


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_what_megaframe_accepts_torchs_schedule_runs(schedule):
    v = 2 if schedule not in ("gpipe", "1f1b") else 1
    for pp in (2, 4):
        for m in range(1, 3 * pp + 2):
            if runs_micro_batches(schedule, pp, v, m):
                assert _torch_accepts(schedule, pp, v, m), (schedule, pp, m)
            else:  # megaframe refuses the counts where torch's schedule would be wasteful or fail
                assert m < pp * stages_per_rank(schedule, v) or schedule in ("interleaved_1f1b", "zero_bubble"), (schedule, m)
    assert any(runs_micro_batches(schedule, 4, v, m) for m in range(1, 20))


def test_stages_sit_where_torch_puts_them():
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for schedule, v, style in (("interleaved_1f1b", 3, "loop"), ("zbv", 2, "v"), ("dualpipev", 2, "v"),
                               ("1f1b", 1, "loop")):
        owner = generate_stage_to_rank_mapping(4, 4 * v, style=style)
        for rank in range(4):
            assert sorted(stage_indices(schedule, 4, v, rank)) == sorted(s for s, r in owner.items() if r == rank)


def test_the_bubble_shrinks_as_the_schedules_promise():
    """At p = 4, m = 8: interleaving by v divides 1F1B's bubble by v, zero-bubble leaves a third of
    it, ZB-V none once m >= 2p; more micro-batches shrink every bubble."""
    one = bubble_fraction("1f1b", 4, 8)
    assert one == pytest.approx(3 / 8) and bubble_fraction("gpipe", 4, 8) == one
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(one / 2)
    assert bubble_fraction("zero_bubble", 4, 8, 2) < bubble_fraction("interleaved_1f1b", 4, 8, 2)
    assert bubble_fraction("zbv", 4, 8) == 0 < bubble_fraction("zbv", 4, 4)
    for schedule in SCHEDULES:
        assert bubble_fraction(schedule, 4, 16, 2) <= bubble_fraction(schedule, 4, 8, 2)
        assert bubble_fraction(schedule, 1, 8, 2) == 0


@pytest.mark.parametrize("layers", [8, 7])
@pytest.mark.parametrize("partition", ["uniform", "parameters"])
@pytest.mark.parametrize("model", ["gpt_tiny", "llama_tiny"])
@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2)])
def test_the_planners_parameters_per_rank_are_the_stages_fsdp2_builds(model, schedule, v, partition, layers):
    """FSDP2's stages built on the meta device for each pipeline rank (a tied embedding's copy on
    the rank of the last stage included) hold what the planner counts for that rank, in either
    partition (parameters: the ends, holding a 4096-row vocabulary, take fewer blocks), with blocks
    that divide into the stages and blocks that do not (uniform's first stages take one more)."""
    from megaframe.backends.fsdp2 import build, pipeline
    from megaframe.config.compose import compose
    from megaframe.model.dims import resolve_dims
    from megaframe.model.factory import build_model
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState
    from megaframe.plan.estimate import estimate_stage
    from megaframe.plan.memory import PlanLayout

    cfg, _ = compose([f"model={model}", f"model.num_layers={layers}"])
    dims = resolve_dims(cfg.model, 4096, tp=1)
    grid = ParallelDims(tp=1, pp=2, dp=1)
    lay = PlanLayout(grid=grid, micro_batch_size=2, global_batch_size=8, zero_stage=2, engine="fsdp2",
                     pipeline_schedule=schedule, virtual_stages=v, partition=partition)
    for rank in range(2):
        ps = ParallelState(grid, rank)
        with build.parameters_on_meta():
            model_ = build_model(dims, ps, 0, initialise=False)
            stages = pipeline.cut_stages(model_, ps, schedule, v, partition)
        held = sum(p.numel() for stage in stages.values() for p in stage.parameters())
        if rank == 0 and layers == 8:  # two stages: 4/4 either way (the ends weigh the same); four: 1, 3, 3, 1
            blocks = [len(r) for r in pipeline.block_ranges(model_, 2 * v, partition)]
            assert sum(blocks) == 8 and (len(set(blocks)) == 1) == (partition == "uniform" or v == 1), blocks
        planned = estimate_stage(dims, lay, "fp32", rank, reserved=0.0, host_counts_as_device=False)
        assert planned.parameters == held, (model, schedule, rank, planned.parameters, held)
        assert all(p.device == torch.device("meta") for stage in stages.values() for p in stage.parameters())
