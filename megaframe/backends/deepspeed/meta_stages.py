"""One rank's pipeline stage as DeepSpeed's PipelineModule builds it, on the meta device and without
process groups (megaframe-plan --dry-run): its layer range from PipelineModule's own partitioning
(DeepSpeed's partition_balanced, deliberately not the planner's faster re-implementation, so the
dry run checks it), its layers from the module classes pipeline.py wraps (EmbeddingPipe is an
Embedding, BlockPipe holds a Block, FinalNormPipe a norm, HeadPipe is a ColumnParallelLinear). No
weights are allocated, so even a 1T-parameter model's stage takes well under a second."""
from __future__ import annotations

import torch
import torch.nn as nn

from megaframe.backends.deepspeed.pipeline import stage_boundaries
from megaframe.backends.facts import MetaStages
from megaframe.model.dims import GPTDims
from megaframe.model.gpt import BlockSpec, build_layer
from megaframe.model.spec import ModelSpec
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.experts import ExpertGroup
from megaframe.parallel.layers import TPGroup


def meta_stages(dims: GPTDims, grid: ParallelDims, rank: int, partition: str, schedule: str,
                virtual_stages: int) -> MetaStages:
    """Rank `rank`'s stage (DeepSpeed's pipeline runs one stage per rank, whatever the schedule)."""
    coords = grid.coords(rank)
    tp = TPGroup(group=None, size=grid.tp, rank=coords.tp)
    ep = ExpertGroup(size=grid.ep, rank=coords.ep)  # which experts this rank holds
    with torch.device("meta"):
        parts = _partition(dims, tp, ep, grid.pp, partition)
        start, stop = parts[coords.pp], parts[coords.pp + 1]
        modules = _stage_modules(dims, tp, ep, start, stop)
        count = sum(p.numel() for p in modules.parameters())
    return MetaStages(stages=(coords.pp,), layers=tuple(range(start, stop)), parameters=count)


def _partition(dims: GPTDims, tp: TPGroup, ep: ExpertGroup, pp: int, partition: str) -> list[int]:
    """PipelineModule._partition_layers: "uniform" is "type:BlockPipe" (weight 1 for blocks, 0 for
    the other layers), "parameters" weighs each layer's parameters."""
    if partition == "uniform":
        weights = [int(layer.kind == "block") for layer in ModelSpec(dims).layers()]
    else:  # measured on built layers, as DeepSpeed's "parameters" method does
        weights = [sum(p.numel() for p in m.parameters())
                   for m in _stage_modules(dims, tp, ep, 0, len(ModelSpec(dims).layers()), share_tied=False)]
    return list(stage_boundaries(tuple(weights), pp))


def _stage_modules(dims: GPTDims, tp: TPGroup, ep: ExpertGroup, start: int, stop: int,
                   share_tied: bool = True) -> nn.ModuleList:
    """Layers [start, stop) of ModelSpec's layer list, as PipelineModule builds them."""
    modules, tied = nn.ModuleList(), None
    for layer in ModelSpec(dims).layers()[start:stop]:
        tied_layer = layer.kind == "embed" or (layer.kind == "head" and dims.tie_embeddings)
        if tied_layer and tied is not None and share_tied:  # DeepSpeed builds a tied module once per stage
            continue
        module = build_layer(layer, dims, tp, None, BlockSpec().with_experts(ep))
        tied = module if tied_layer else tied
        modules.append(module)
    return modules
