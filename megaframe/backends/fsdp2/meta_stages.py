"""One rank's pipeline stages as FSDP2's engine cuts them (engine.py: the model built whole on the
meta device, then pipeline.cut_stages), without process groups and before any fully_shard
(megaframe-plan --dry-run): a looped schedule's rank holds several stages, a V's rank 0 the first
and the last, and a tied embedding's last stage a copy of the token table."""
from __future__ import annotations

from megaframe.backends.facts import MetaStages
from megaframe.backends.fsdp2.build import parameters_on_meta
from megaframe.backends.fsdp2.pipeline import cut_stages
from megaframe.model.dims import GPTDims
from megaframe.model.factory import build_model
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState


def meta_stages(dims: GPTDims, grid: ParallelDims, rank: int, partition: str, schedule: str,
                virtual_stages: int) -> MetaStages:
    """Rank `rank`'s stages under `schedule`, by the engine's own code."""
    ps = ParallelState(grid, rank)
    with parameters_on_meta():
        stages = cut_stages(build_model(dims, ps, 0, initialise=False), ps, schedule, virtual_stages, partition)
    n, layers = dims.num_layers, []
    for stage in stages.values():  # ModelSpec's list: embed | block i at i + 1 | final_norm | head
        layers += [0] if stage.first else []
        layers += [int(i) + 1 for i in stage.blocks]
        layers += [n + 1, n + 2] if stage.last else []
    held = sum(p.numel() for stage in stages.values() for p in stage.parameters())
    return MetaStages(stages=tuple(stages), layers=tuple(layers), parameters=held)
