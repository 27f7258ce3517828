"""Dry run: build one rank's shard of a model on the meta device, without process groups.

Rank r gets its coordinates from ParallelDims; a whole model (pp = 1) is GPT as every engine builds
it, and a pipeline rank's stages are its engine's to build (the plug's meta_stages: DeepSpeed's
PipelineModule partition, FSDP2's stages under its schedule), by the engine's own code. No weights
are allocated, so even a 1T-parameter model's stage takes seconds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.backends.facts import MetaStages
from megaframe.backends.registry import DEFAULT, engine
from megaframe.model.gpt import GPT, GPTDims
from megaframe.model.spec import Layer, ModelSpec
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.experts import ExpertGroup
from megaframe.parallel.layers import TPGroup


@dataclass(frozen=True)
class DryRun:
    """What the meta-device build of one rank holds."""

    rank: int
    stage: int  # the rank's pipeline coordinate
    tp_rank: int
    stages: tuple[int, ...]  # the pipeline stages it runs (several under FSDP2's looped and V schedules)
    layers: list[str]
    parameters: int


def _layer_name(layer: Layer, dims: GPTDims) -> str:
    """How the dry run reports a layer: embed, block 3, final_norm, head or head (tied embed)."""
    if layer.kind == "block":
        return f"block {layer.block}"
    return "head (tied embed)" if layer.kind == "head" and dims.tie_embeddings else layer.kind


def _whole(dims: GPTDims, grid: ParallelDims, rank: int) -> MetaStages:
    coords = grid.coords(rank)
    with torch.device("meta"):
        model = GPT(dims, TPGroup(group=None, size=grid.tp, rank=coords.tp),
                    ep=ExpertGroup(size=grid.ep, rank=coords.ep))  # which experts this rank holds
        count = sum(p.numel() for p in model.parameters())
    return MetaStages(stages=(0,), layers=tuple(range(len(ModelSpec(dims).layers()))), parameters=count)


def dry_run(dims: GPTDims, grid: ParallelDims, rank: int, partition: str = "uniform", engine_name: str = DEFAULT,
            schedule: str = "1f1b", virtual_stages: int = 1) -> DryRun:
    """Build rank `rank`'s shard on the meta device and count its parameters."""
    coords = grid.coords(rank)
    built = _whole(dims, grid, rank) if grid.pp == 1 else \
        engine(engine_name).meta_stages(dims, grid, rank, partition, schedule, virtual_stages)
    layers = ModelSpec(dims).layers()
    return DryRun(rank, coords.pp, coords.tp, built.stages, [_layer_name(layers[i], dims) for i in built.layers],
                  built.parameters)
