"""build_model(): an initialised model for resolved GPTDims."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from megaframe.common.compile_breaks import disable_marked
from megaframe.config.schema import ModelConfig
from megaframe.model.dims import GPTDims, resolve_dims  # noqa: F401  (resolve_dims: re-exported)
from megaframe.model.gpt import GPT, Block, init_parameters
from megaframe.parallel.random import TPDropoutRNG
from megaframe.parallel.state import ParallelState


def build_model(dims: GPTDims, ps: ParallelState, seed: int, activation_checkpointing: bool = False,
                sequence_parallel: bool = False, grad_bucket=None, write_init=None, cp_impl: str = "ring",
                built_shape=None, expert_marks=None, initialise: bool = True, matmul=None) -> nn.Module:
    """An initialised GPT holding this rank's tensor-parallel shard (whole: pipeline stages are the engine's).
    grad_bucket: sum TP-replicated gradients once per step (parallel/grad_bucket.py);
    write_init(param, value): how a parameter takes its initial value (default: a copy; a model
    built partitioned writes its ZeRO-3 piece) and built_shape(param) the shape it was built with;
    cp_impl: how attention crosses the cp ranks when ps has cp > 1 (ring or ulysses); expert_marks:
    what the engine marks on each expert shard (parallel/experts.py); initialise=False: leave the
    parameters as built (an engine that builds them on the meta device fills its shards later);
    matmul: the MatmulRecipe every weight matmul computes through (parallel/matmul.py; None: default)."""
    if ps.pp != 1 and initialise:  # an engine may cut a model built whole on the meta device into stages
        raise NotImplementedError("a pipeline-parallel model is built by its engine's pipeline, not whole")
    model = GPT(dims, tp=ps.tp_region(sequence_parallel, grad_bucket, matmul), rng=TPDropoutRNG(seed, ps.tp_rank, ps.cp_rank),
                activation_checkpointing=activation_checkpointing, context=ps.context(), cp_impl=cp_impl,
                ep=ps.experts(expert_marks))
    hooks = {"write": write_init, "built_shape": built_shape}
    if initialise:
        init_parameters(model, "", dims, seed, **{k: v for k, v in hooks.items() if v is not None})
    return model


def layer_parameters(model: GPT) -> list[int]:
    """This rank's parameters of each layer of the layer list (embed | blocks | final norm | head), the
    weights a "parameters" pipeline partition balances, from a GPT built on the meta device or not, as
    the planner counts them (plan/memory.py pipeline_layer_parameters): a tied head counts the
    embedding again, as DeepSpeed's TiedLayerSpec does."""
    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())
    embed = count(model.embed)
    return [embed, *(count(block) for block in model.blocks), count(model.final_norm),
            count(model.head) if model.head is not None else embed]


def meta_layer_parameters(dims: GPTDims, ps: ParallelState) -> list[int]:
    """layer_parameters of this rank's layout, from a build on the meta device: no memory, nothing drawn."""
    with torch.device("meta"):
        return layer_parameters(build_model(dims, ps, 0, initialise=False))


def compile_model(model: nn.Module, scope: str) -> int:
    """train.compile: scope "blocks" (compile_blocks), or "model": the whole module's forward as one
    graph, in place (names and checkpoints unchanged), which validation allows only where that
    forward runs in one process without collectives. Returns the blocks compiled either way."""
    if scope == "model":
        disable_marked()
        model.compile()
        return sum(isinstance(m, Block) for m in model.modules())
    return compile_blocks(model)


def compile_blocks(model: nn.Module) -> int:
    """torch.compile every transformer block in place; returns how many.

    Blocks, not the whole model (as torchtitan does): all blocks share one compiled graph (torch
    treats their parameters as inputs), so compile time does not grow with depth; parameter names,
    and with them checkpoints, stay those of the eager model; the embedding and DeepSpeed's
    pipeline schedule stay eager. The GPT's final norm, head and loss are one more graph. Inductor fuses each block's elementwise ops
    (norms, RoPE, SwiGLU, residual adds): 1.2x the eager tokens/s on the bench's llama on CPU
    (BENCHMARKS.md); the matmuls are the same either way.
    """
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    disable_marked()  # the collectives and routing break the graph (compile_breaks.py)
    for block in blocks:
        block.compile()
    if isinstance(model, GPT):
        # the final norm, the head and the loss: one more graph, which a whole-model compile would
        # fuse too (the fp32 upcast and log-softmax of the logits); bound here, names unchanged
        model.head_loss = torch.compile(model.head_loss)
    return len(blocks)


def count_parameters(model: nn.Module, full: bool = False, numel=lambda p: p.numel()) -> int:
    """Parameters of this rank's module, each numel(p) (an engine that partitioned them says their
    gathered size); full=True counts tensor-parallel shards at their unsharded size, i.e. the whole
    model."""
    total = 0
    for p in model.parameters():
        shape = getattr(p, "partition_shape", None) if full else None
        total += math.prod(shape) if shape else numel(p)
    return total
