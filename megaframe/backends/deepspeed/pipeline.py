"""The GPT as a DeepSpeed PipelineModule, from the same blocks as the plain model.

Layer list: ModelSpec.layers(), Embedding | Block x num_layers | FinalNorm | LM head (GPT-2's head
is the token embedding again, a TiedLayerSpec shared by the first and last stage). Every layer initialises its
parameters from their canonical names (embed.*, blocks.{i}.*, final_norm.*, head.*), so a
pipelined model starts from exactly the weights of the plain one.

Layers pass hidden states; with attention masks (data.document_mask, model.sliding_window) they
pass (hidden states, token ids), so that every stage finds the micro-batch's documents in the
token ids on its own device (DeepSpeed sends an integer tensor of a tuple along and sends no
gradient back for it); a stage derives its documents and masks once per micro-batch (StageMasks).
"""
from __future__ import annotations

import contextlib
import io
import re
from functools import lru_cache
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.utils import partition_balanced

from megaframe.backends.deepspeed.experts import deepspeed_expert_marks
from megaframe.backends.deepspeed.topology import build_topology
from megaframe.model.factory import meta_layer_parameters
from megaframe.model.gpt import (BlockSpec, Embedding, GPTDims, RopeTables, build_layer, init_parameters,
                                 register_positions, run_block, tied_head_logits)
from megaframe.model.masking import Documents, ForwardMasks, StepTargets, documents_of, forward_masks
from megaframe.model.moe import AttachAux, MoE, RouterStats
from megaframe.model.spec import Layer, ModelSpec
from megaframe.parallel.context import ContextGroup
from megaframe.parallel.cross_entropy import vocab_parallel_cross_entropy
from megaframe.parallel.experts import ExpertGroup
from megaframe.parallel.layers import ColumnParallelLinear, TPGroup
from megaframe.parallel.random import TPDropoutRNG
from megaframe.parallel.state import ParallelState


class StageMasks:
    """What a stage's layers derive from a micro-batch's token ids, once per micro-batch and stage:
    its documents, their RoPE rows and the blocks' masks (ForwardMasks). DeepSpeed calls each layer
    on the one before's output; the token-id tensor handed along is one object through a stage's
    layers and a new one for each micro-batch (loaded or received, then cloned), so it is the key.
    Holds the last micro-batch's until the next one's. Under context parallelism (context) the ids
    are this rank's zig-zag shard: the documents are cut in the whole rows (one all-gather of the ids
    per micro-batch and stage, documents_of), whose positions the RoPE rows cover."""

    def __init__(self, dims: GPTDims, rope: RopeTables, context: Optional[ContextGroup] = None):
        self.dims, self.rope, self.context = dims, rope, context
        self._ids: Optional[torch.Tensor] = None  # a reference, not an id(): identity is the key
        self.documents: Optional[Documents] = None
        self.rope_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.masks: Optional[ForwardMasks] = None

    def of(self, ids: torch.Tensor) -> "StageMasks":
        """This cache, holding what the micro-batch of token ids `ids` (B, T) gives."""
        if ids is not self._ids:
            length = ids.shape[1]
            self.documents = documents_of(ids, self.dims, self.context)
            self.rope_rows = None if self.documents is None or self.dims.position_embedding != "rope" else \
                self.documents.rope(self.rope(self.documents.length, ids.device))
            self.masks = forward_masks(self.dims, self.documents, length, ids.device)
            self._ids = ids
        return self


def carries_token_ids(dims: GPTDims) -> bool:
    """Whether the pipeline's layers pass (hidden states, token ids): where attention is masked."""
    return dims.document_mask or dims.sliding_window is not None


class EmbeddingPipe(Embedding):
    """Stage-0 layer: token ids (B, T) -> hidden states (and the token ids, under masks)."""

    def __init__(self, dims: GPTDims, tp: TPGroup, rng: Optional[TPDropoutRNG], seed: int,
                 context: Optional[ContextGroup] = None, stage_masks: Optional[StageMasks] = None):
        super().__init__(dims, tp, rng)
        register_positions(self, dims, context)  # stages pass only hidden states: each layer keeps its own
        self.stage_masks = stage_masks
        init_parameters(self, "embed", dims, seed)

    def forward(self, idx: torch.Tensor):
        if self.stage_masks is None:
            return super().forward(idx, self.positions)
        documents = self.stage_masks.of(idx).documents  # positions restart at each document
        return super().forward(idx, self.positions if documents is None else documents.positions), idx


class BlockPipe(nn.Module):
    """One transformer block; RoPE tables are recomputed here since stages pass only hidden states.

    A Mixture-of-Experts block's router losses cannot join the loss, which only the last stage
    has: they are attached to the block's output (AttachAux) with the gradient DeepSpeed's
    pipeline gives each micro-batch's loss, 1/aux_scale_steps."""

    def __init__(self, dims: GPTDims, tp: TPGroup, rng: Optional[TPDropoutRNG], seed: int, prefix: str,
                 recompute: bool, spec: BlockSpec, context: Optional[ContextGroup] = None, cp_impl: str = "ring",
                 rope: Optional[RopeTables] = None, index: int = 0, ep: ExpertGroup = ExpertGroup(),
                 router_stats: Optional[RouterStats] = None, accumulation_steps: int = 1,
                 stage_masks: Optional[StageMasks] = None):
        super().__init__()
        self.dims, self.rng, self.recompute, self.stage_masks = dims, rng, recompute, stage_masks
        register_positions(self, dims, context)
        self.rope = rope or RopeTables(dims)  # one per stage: its blocks share the tables
        self.block = build_layer(Layer("block", prefix, index), dims, tp, rng, spec.across(context, cp_impl).with_experts(ep))
        self.router_stats, self.aux_scale = router_stats, 1.0 / accumulation_steps
        init_parameters(self.block, prefix, dims, seed)

    def forward(self, inputs):
        """hidden states, or (hidden states, token ids) under masks: the same out as in."""
        x, ids = inputs if isinstance(inputs, tuple) else (inputs, None)
        held = None if ids is None else self.stage_masks.of(ids)
        rope = self.rope(self.dims.seq_length, x.device, self.positions) if self.dims.position_embedding == "rope" \
            else None
        if held is not None and held.rope_rows is not None:  # under documents: each token's own position
            rope = held.rope_rows
        mask = None if held is None or held.masks is None else held.masks.resolve(self.block.attn)
        x = run_block(self.block, x, rope, self.rng, self.recompute and self.training, mask)
        if isinstance(self.block.mlp, MoE) and self.training:
            self.router_stats.add([self.block.mlp])
            x = AttachAux.apply(x, self.block.mlp.aux_loss, self.aux_scale)
        return x if ids is None else (x, ids)


class FinalNormPipe(nn.Module):
    """The final norm before the LM head."""

    def __init__(self, dims: GPTDims, tp: TPGroup, seed: int):
        super().__init__()
        self.norm = build_layer(Layer("final_norm", "final_norm"), dims, tp)
        init_parameters(self.norm, "final_norm", dims, seed)

    def forward(self, inputs) -> torch.Tensor:
        return self.norm(inputs[0] if isinstance(inputs, tuple) else inputs)  # the token ids end here


class HeadPipe(ColumnParallelLinear):
    """Untied LM head (Llama): column-parallel over the padded vocabulary."""

    def __init__(self, dims: GPTDims, tp: TPGroup, seed: int):
        super().__init__(dims.hidden_size, dims.padded_vocab_size, tp, bias=False, kind="head")
        init_parameters(self, "head", dims, seed)


class VocabParallelLoss:
    """PipelineModule's loss_fn: cross-entropy over this TP rank's vocabulary shard of the logits."""

    def __init__(self, dims: GPTDims, tp: TPGroup):
        self.dims, self.tp, self.vocab_size = dims, tp, dims.vocab_size
        self.vocab_start = tp.rank * (dims.padded_vocab_size // tp.size)
        self.gate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # set for one train step (skip_gate.py)
        self.step_targets = StepTargets()  # data.eod_mask_loss: set by the engine for a step or an evaluation

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # targets data.eod_mask_loss leaves out come as IGNORED_TARGET (data/dataset.py windows_batch)
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp, self.vocab_start, self.vocab_size)
        weighed = self.step_targets.weigh(loss, targets)
        loss = loss if weighed is None else weighed
        return self.gate(loss) if self.gate is not None else loss


PARTITION_METHODS = {"uniform": "type:BlockPipe", "parameters": "parameters"}


class CountedPipelineModule(PipelineModule):
    """A PipelineModule whose "parameters" partition weighs each layer by counts from a build on the
    meta device: DeepSpeed's own count builds every layer of the model on every rank, one at a time,
    each initialised (drawn) and dropped: at gpt_1t's layout 128 blocks' TP shards per rank to keep 2."""

    def __init__(self, *args, layer_parameters: Optional[list[int]] = None, **kwargs):
        object.__setattr__(self, "_layer_parameters", layer_parameters)  # read during PipelineModule's __init__
        super().__init__(*args, **kwargs)

    def _count_layer_params(self) -> list[int]:  # asked only under partition_method="parameters"
        return list(self._layer_parameters)


def build_pipeline_model(dims: GPTDims, ps: ParallelState, seed: int, partition: str = "uniform",
                         activation_checkpointing: bool = False, sequence_parallel: bool = False,
                         spec: Optional[ModelSpec] = None, grad_bucket=None, cp_impl: str = "ring",
                         accumulation_steps: int = 1, matmul=None) -> PipelineModule:
    """This rank's stage of the pipelined GPT: ModelSpec's layer list as DeepSpeed LayerSpecs, on
    the topology built from ParallelState's grid (whose data axis is dp x cp); matmul: the
    MatmulRecipe of the weight matmuls (parallel/matmul.py; None: default)."""
    spec = spec or ModelSpec(dims)
    tp = ps.tp_region(sequence_parallel, grad_bucket, matmul)
    rng = TPDropoutRNG(seed, ps.tp_rank, ps.cp_rank)
    context = ps.context()
    rope = RopeTables(dims)
    router_stats = RouterStats(dims.num_moe_blocks)  # the stage's MoE blocks share it
    stage_masks = StageMasks(dims, rope, context) if carries_token_ids(dims) else None  # the stage's layers share it
    embed_args = (EmbeddingPipe, dims, tp, rng, seed, context, stage_masks)
    layers: list = []
    for layer in spec.layers():
        if layer.kind == "embed":
            layers.append(TiedLayerSpec("embed", *embed_args, tied_weight_attr=["tok.weight"])
                          if dims.tie_embeddings else LayerSpec(*embed_args))
        elif layer.kind == "block":
            layers.append(LayerSpec(BlockPipe, dims, tp, rng, seed, layer.prefix, activation_checkpointing,
                                    spec.block or BlockSpec(), context, cp_impl, rope, layer.block, ps.experts(deepspeed_expert_marks),
                                    router_stats, accumulation_steps, stage_masks))
        elif layer.kind == "final_norm":
            layers.append(LayerSpec(FinalNormPipe, dims, tp, seed))
        elif dims.tie_embeddings:  # the head is the embedding again
            layers.append(TiedLayerSpec("embed", *embed_args, forward_fn=tied_head_logits, tied_weight_attr=["tok.weight"]))
        else:
            layers.append(LayerSpec(HeadPipe, dims, tp, seed))
    # "uniform" balances transformer blocks (Megatron's notion), not DeepSpeed's raw layer count
    # DeepSpeed prints its seed settings, its topology and each stage's layers on rank 0 (print, not
    # its logger): nothing a user can act on; megaframe's start-up line says the layout. No grad: its
    # broadcast of a tied embedding's values (_synchronize_tied_weights) is a copy between stages,
    # no step of any loss; recorded by autograd, each rank's first backward warned that c10d's
    # broadcast_ has no autograd kernel and "may lead to silently incorrect behavior"
    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        counts = meta_layer_parameters(dims, ps) if partition == "parameters" else None
        model = CountedPipelineModule(layers=layers, loss_fn=VocabParallelLoss(dims, tp),
                                      topology=build_topology(ps.grid), partition_method=PARTITION_METHODS[partition],
                                      activation_checkpoint_interval=0,
                                      layer_parameters=counts)
    model.rng = rng  # a tied embedding's non-owning copies carry DeepSpeed's ds_pipe_replicated=True
    model.moe_layers = [m for m in model.modules() if isinstance(m, MoE)]  # this stage's, as GPT.moe_layers
    model.router_stats = router_stats
    return model


def counted_on_another_stage(param: nn.Parameter) -> bool:
    """A tied embedding's copy on the last stage: the pipeline marks it ds_pipe_replicated, and the
    first stage counts it (for the gradient norm)."""
    return getattr(param, "ds_pipe_replicated", False)


@lru_cache(maxsize=64)
def stage_boundaries(weights: tuple, pp: int) -> tuple:
    """Where PipelineModule cuts a layer list of these weights into pp stages (DeepSpeed's own
    partition_balanced: the dry run uses it to check the planner's re-implementation)."""
    return tuple(int(p) for p in partition_balanced(weights=list(weights), num_parts=pp))


# the attribute under which each pipeline wrapper keeps the plain model's module
_WRAPPED = {"block": "block.", "final_norm": "norm."}


def canonical_name(module_name: str, layers: Sequence[Layer]) -> str:
    """The canonical (plain tp=1 GPT) name of a PipelineModule parameter.

    PipelineModule names its layers by their index in ModelSpec.layers(); BlockPipe keeps the
    Block as .block, FinalNormPipe the norm as .norm; a tied embedding lives in tied_modules.embed
    on the first and the last stage."""
    if module_name.startswith("tied_modules.embed."):
        return "embed." + module_name[len("tied_modules.embed."):]
    match = re.fullmatch(r"(\d+)\.(.+)", module_name)
    if not match or int(match.group(1)) >= len(layers):
        raise ValueError(f"unexpected pipeline parameter name {module_name!r}")
    layer, rest = layers[int(match.group(1))], match.group(2)
    return f"{layer.prefix}.{rest.removeprefix(_WRAPPED.get(layer.kind, ''))}"
