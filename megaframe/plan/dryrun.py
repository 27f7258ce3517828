"""Dry run: build one rank's shard of a model on the meta device, without process groups.

Rank r gets its coordinates from ParallelDims (the pipeline engine's topology is built from it),
its layer range from the same DeepSpeed partitioning PipelineModule applies, and its layers from
the same module classes (backends/deepspeed/pipeline.py wraps exactly these: EmbeddingPipe is an Embedding,
BlockPipe holds a Block, FinalNormPipe a norm, HeadPipe is a ColumnParallelLinear). No weights are
allocated, so even a 1T-parameter model's stage takes well under a second.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from megaframe.backends.registry import engine
from megaframe.model.gpt import GPT, BlockSpec, GPTDims, build_layer
from megaframe.model.spec import Layer, ModelSpec
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.experts import ExpertGroup
from megaframe.parallel.layers import TPGroup
from megaframe.plan.memory import uniform_weights


@dataclass(frozen=True)
class DryRun:
    """What the meta-device build of one rank holds."""

    rank: int
    stage: int
    tp_rank: int
    layers: list[str]
    parameters: int


def _layer_parameters(dims: GPTDims, tp: TPGroup, ep: ExpertGroup) -> list[int]:
    """Per-layer parameter counts as DeepSpeed's "parameters" method measures them (built layers)."""
    _, modules = _stage_modules(dims, tp, ep, 0, len(ModelSpec(dims).layers()), share_tied=False)
    return [sum(p.numel() for p in m.parameters()) for m in modules]


def _partition(dims: GPTDims, tp: TPGroup, ep: ExpertGroup, pp: int, partition: str) -> list[int]:
    """PipelineModule._partition_layers, with the engine's own helper (deliberately not the planner's
    faster re-implementation, so the dry run checks it)."""
    if partition == "uniform":  # "type:BlockPipe": weight 1 for blocks, 0 for the other layers
        weights = uniform_weights(dims)
    else:
        weights = _layer_parameters(dims, tp, ep)
    return list(engine().stage_boundaries(tuple(weights), pp))


def _stage_modules(dims: GPTDims, tp: TPGroup, ep: ExpertGroup, start: int, stop: int,
                   share_tied: bool = True) -> tuple[list[str], nn.ModuleList]:
    """Layers [start, stop) of ModelSpec's layer list, as PipelineModule builds them."""
    layers = ModelSpec(dims).layers()[start:stop]
    modules, tied = nn.ModuleList(), None
    for layer in layers:
        tied_layer = layer.kind == "embed" or (layer.kind == "head" and dims.tie_embeddings)
        if tied_layer and tied is not None and share_tied:  # DeepSpeed builds a tied module once per stage
            continue
        module = build_layer(layer, dims, tp, None, BlockSpec().with_experts(ep))
        tied = module if tied_layer else tied
        modules.append(module)
    return [_layer_name(layer, dims) for layer in layers], modules


def _layer_name(layer: Layer, dims: GPTDims) -> str:
    """How the dry run reports a layer: embed, block 3, final_norm, head or head (tied embed)."""
    if layer.kind == "block":
        return f"block {layer.block}"
    return "head (tied embed)" if layer.kind == "head" and dims.tie_embeddings else layer.kind


def dry_run(dims: GPTDims, grid: ParallelDims, rank: int, partition: str = "uniform") -> DryRun:
    """Build rank `rank`'s shard on the meta device and count its parameters."""
    coords, tp, pp = grid.coords(rank), grid.tp, grid.pp
    group = TPGroup(group=None, size=tp, rank=coords.tp)
    experts = ExpertGroup(size=grid.ep, rank=coords.ep)  # which experts this rank holds
    with torch.device("meta"):
        if pp == 1:
            model = GPT(dims, group, ep=experts)
            names = [_layer_name(layer, dims) for layer in ModelSpec(dims).layers()]
        else:
            parts = _partition(dims, group, experts, pp, partition)
            names, model = _stage_modules(dims, group, experts, parts[coords.pp], parts[coords.pp + 1])
        count = sum(p.numel() for p in model.parameters())
    return DryRun(rank, coords.pp, coords.tp, names, count)
