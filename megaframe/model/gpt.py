"""GPT in two flavours, chosen by config: GPT-2 (LayerNorm, GELU, learned positions, tied
embeddings) and Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head).

Reads top to bottom like nanoGPT. Linear layers are Megatron's column/row-parallel ones; with
tp=1 they are plain linears and every collective is the identity. Under tensor parallelism a rank
holds its slice of the heads, MLP width and vocabulary; under sequence parallelism the residual
stream between TP regions is split along the sequence.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaframe.model.attention import CAUSAL, SDPA_HAS_GQA, Mask, build_attention_core, decode_attention
from megaframe.model.dims import GPTDims
from megaframe.model.init_values import InitValue
from megaframe.model.mlp import MLP, Dropout
from megaframe.model.moe import AddAux, MoE, RouterStats
from megaframe.model.recompute import checkpointed
from megaframe.model.layer_list import Layer, layer_list
from megaframe.model.masking import StepTargets, documents_of, forward_masks, layer_mask
from megaframe.parallel.context import ContextGroup, zigzag_positions
from megaframe.parallel.experts import ExpertGroup
from megaframe.parallel.cross_entropy import vocab_parallel_cross_entropy
from megaframe.parallel.layers import (ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding,
                                       at_least_fp32)
from megaframe.parallel.mappings import gather_from_tp_region, scatter_to_sequence_parallel_region
from megaframe.parallel.random import TPDropoutRNG


class LayerNorm(nn.Module):
    """LayerNorm whose gain (and bias) gradients are summed over TP ranks under sequence parallelism."""

    def __init__(self, dims: GPTDims, tp: TPGroup):
        super().__init__()
        self.tp, self.eps = tp, dims.norm_eps
        self.weight = nn.Parameter(torch.ones(dims.hidden_size))
        self.bias = nn.Parameter(torch.zeros(dims.hidden_size)) if dims.bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.tp.sync_grad(self.bias)
        return F.layer_norm(x, x.shape[-1:], self.tp.sync_grad(self.weight), bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): no mean subtraction, no bias. width: what it normalises (the
    hidden size, or one head's size for QK-norm, whose gain then serves this TP rank's heads only)."""

    def __init__(self, dims: GPTDims, tp: TPGroup, width: Optional[int] = None):
        super().__init__()
        self.tp, self.eps = tp, dims.norm_eps
        self.per_head = width is not None
        self.weight = nn.Parameter(torch.ones(width or dims.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability under bf16, as Llama does
        x32 = at_least_fp32(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.tp.sync_grad(self.weight, on_shards=True if self.per_head else None)
        return weight * x32.to(x.dtype)


def build_norm(dims: GPTDims, tp: TPGroup) -> nn.Module:
    """LayerNorm or RMSNorm as the config says."""
    return RMSNorm(dims, tp) if dims.norm == "rmsnorm" else LayerNorm(dims, tp)


_ROPE_CACHE: dict = {}


def rope_tables(dims: GPTDims, seq_len: int, device=None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables of shape (T, hs) for positions offset .. offset+T-1, in the rotate-half
    layout Hugging Face's Llama uses (offset: where a sequence chunk starts, under context
    parallelism or when continuing a sequence).

    Cached: they depend only on the shape, and recomputing them every forward costs time."""
    key = (dims.head_dim, dims.rope_theta, seq_len, offset, str(device))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = _rope_tables(dims, seq_len, device, offset)
    return _ROPE_CACHE[key]


class RopeTables:
    """The cos/sin a model's blocks use: the cached tables of positions 0..T-1, or under context
    parallelism their rows at this rank's zig-zag positions, gathered once per device and kept (not
    a gather per forward, and no host read of the positions)."""

    def __init__(self, dims: GPTDims):
        self.dims = dims
        self.rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __call__(self, seq_len: int, device, positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            return rope_tables(self.dims, seq_len, device)
        if self.rows is None or self.rows[0].device != positions.device:
            cos, sin = rope_tables(self.dims, self.dims.seq_length, positions.device)
            self.rows = (cos[positions], sin[positions])
        return self.rows


def register_positions(module: nn.Module, dims: GPTDims, context: Optional[ContextGroup]) -> None:
    """module.positions: where this rank's tokens sit in their sequences under context parallelism
    (a buffer built once, moved with the module), None otherwise; module.context: the cp group."""
    module.context = context  # the cp group: documents are found in the whole rows (model/masking.py)
    if context is None:
        module.positions = None
    else:
        module.register_buffer("positions", zigzag_positions(dims.seq_length, context.size, context.rank),
                               persistent=False)


def _rope_tables(dims: GPTDims, seq_len: int, device=None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, dims.head_dim, 2, device=device).float() / dims.head_dim))
    positions = torch.arange(offset, offset + seq_len, device=device).float()
    angles = torch.outer(positions, inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, nh, T, hs) query/key vectors by position (in fp32, also under bf16)."""
    x32 = at_least_fp32(x)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class ReplicatedLinear(nn.Module):
    """A full linear layer on every TP rank whose ranks use different parts of its output
    (kv heads when tp exceeds them): its gradient is summed over the TP group."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool):
        super().__init__()
        self.tp = tp
        self.matmul = tp.site("replicated")
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.tp.sync_grad(self.bias, on_shards=True)
        return self.matmul.linear(x, self.tp.sync_grad(self.weight, on_shards=True), bias)


class Attention(nn.Module):
    """Causal self-attention; query heads split over TP ranks, kv heads split or (if fewer) replicated."""

    def __init__(self, dims: GPTDims, tp: TPGroup, rng: Optional[TPDropoutRNG],
                 context: Optional[ContextGroup] = None, cp_impl: str = "ring"):
        super().__init__()
        self.dims, self.tp, self.rng = dims, tp, rng
        hs, nkv = dims.head_dim, dims.num_kv_heads
        self.local_heads = dims.num_heads // tp.size
        self.q_proj = ColumnParallelLinear(dims.hidden_size, dims.num_heads * hs, tp, dims.bias, enter=False)
        kv_split = nkv % tp.size == 0
        if kv_split:
            self.k_proj = ColumnParallelLinear(dims.hidden_size, nkv * hs, tp, dims.bias, enter=False)
            self.v_proj = ColumnParallelLinear(dims.hidden_size, nkv * hs, tp, dims.bias, enter=False)
        else:
            self.k_proj = ReplicatedLinear(dims.hidden_size, nkv * hs, tp, dims.bias)
            self.v_proj = ReplicatedLinear(dims.hidden_size, nkv * hs, tp, dims.bias)
        held_kv = nkv // tp.size if kv_split else nkv  # kv heads this rank computes
        kv_start = tp.rank * held_kv if kv_split else 0
        # the kv head serving each local query head (grouped-query attention); None when one-to-one
        q_start, group = tp.rank * self.local_heads, dims.num_heads // nkv
        kv_index = [(q_start + j) // group - kv_start for j in range(self.local_heads)]  # plain ints: meta-safe
        one_to_one = group == 1 and kv_split
        # SDPA repeats kv heads itself (no copy) when this rank holds just the kv heads it uses
        # (replicated kv holds all of them) and each serves the same number of consecutive query
        # heads; other mappings index explicitly
        local_kv = len(set(kv_index))
        per_kv = self.local_heads // local_kv
        self.sdpa_gqa = (SDPA_HAS_GQA and not one_to_one and held_kv == local_kv
                         and self.local_heads % local_kv == 0
                         and kv_index == [i // per_kv for i in range(self.local_heads)])
        explicit = None if one_to_one or self.sdpa_gqa else torch.tensor(kv_index)
        self.register_buffer("kv_index", explicit, persistent=False)
        self.out_proj = RowParallelLinear(dims.num_heads * hs, dims.hidden_size, tp, dims.bias)
        # QK-norm (Qwen3): RMSNorm over each query and key head, before RoPE
        self.q_norm = RMSNorm(dims, tp, width=hs) if dims.qk_norm else None
        self.k_norm = RMSNorm(dims, tp, width=hs) if dims.qk_norm else None
        # the run's one attention core (model/attention.py) and the mask this block attends with;
        # under context parallelism (context) the core attends across this rank's zig-zag shard
        self.core = build_attention_core(dims.dropout, rng, self.sdpa_gqa, context, cp_impl, dims.attention_core)
        self.mask = CAUSAL
        self.resid_dropout = Dropout(dims.dropout, rng, split_across_tp=tp.sequence_parallel)

    def forward(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]],
                mask: Optional[Mask] = None) -> torch.Tensor:
        """mask: this forward's mask for the block (model/masking.py's ForwardMasks), else its own."""
        x = self.tp.enter(x)  # (B, T, C) on every TP rank (all-gathered along T under SP)
        B, T, _ = x.shape
        hs = self.dims.head_dim
        q = self.q_proj(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh/tp, T, hs)
        k = self.k_proj(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nkv local, T, hs)
        v = self.v_proj(x).view(B, T, -1, hs).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope if rope[0].dim() > 2 else (rope[0][:T], rope[1][:T])  # per token under documents
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_index is not None:
            k, v = k[:, self.kv_index], v[:, self.kv_index]  # (B, nh/tp, T, hs)
        y = self.core(q, k, v, self.mask if mask is None else mask)  # (B, nh/tp, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh/tp * hs)
        return self.resid_dropout(self.out_proj(y))

    def forward_cached(self, x: torch.Tensor, rope: Optional[tuple[torch.Tensor, torch.Tensor]], cache,
                       layer: int) -> torch.Tensor:
        """forward() for new tokens x (B, T, C) that follow those of a KVCache (model/generate.py),
        whose keys and values they join: generation only (tp=1, no cp, no dropout). rope: the
        cos/sin rows of the new tokens' positions."""
        B, T, _ = x.shape
        hs = self.dims.head_dim
        q = self.q_proj(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, -1, hs).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        past = cache.length
        k, v = cache.store(layer, k, v)  # (B, nkv, past + T, hs)
        if self.kv_index is not None:
            k, v = k[:, self.kv_index], v[:, self.kv_index]  # (B, nh, past + T, hs)
        y = decode_attention(q, k, v, past, self.sdpa_gqa)  # (B, nh, T, hs)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


@dataclass(frozen=True)
class BlockSpec:
    """The modules a block is built from, each called as (dims, tp[, rng]): `across` hands the cp
    group to `attention`, whose core (model/attention.py) then attends across the cp ranks, the
    block around it unchanged; blocks the config makes Mixture-of-Experts (model.moe) take `moe`
    for their MLP."""

    attention: Callable[..., nn.Module] = Attention
    mlp: Callable[..., nn.Module] = MLP
    norm: Callable[..., nn.Module] = build_norm
    moe: Callable[..., nn.Module] = MoE

    def across(self, context: Optional[ContextGroup], cp_impl: str) -> "BlockSpec":
        """This spec with attention across the cp ranks of `context` (unchanged without one); the
        router's token counts then span the cp ranks too."""
        if context is None:
            return self
        return dataclasses.replace(self, attention=functools.partial(self.attention, context=context, cp_impl=cp_impl),
                                   moe=functools.partial(self.moe, context=context))

    def with_experts(self, ep: ExpertGroup) -> "BlockSpec":
        """This spec with MoE layers holding this rank's share of the experts (parallel.ep)."""
        return self if ep.size == 1 else dataclasses.replace(self, moe=functools.partial(self.moe, ep=ep))


class Block(nn.Module):
    """Pre-norm transformer block (on sequence shards between the TP regions under SP); block
    `index` has a Mixture-of-Experts MLP where the config says so."""

    def __init__(self, dims: GPTDims, tp: TPGroup, rng: Optional[TPDropoutRNG], spec: BlockSpec = BlockSpec(),
                 index: int = 0):
        super().__init__()
        self.attn_norm = spec.norm(dims, tp)
        self.attn = spec.attention(dims, tp, rng)
        if dims.sliding_window is not None:
            self.attn.mask = layer_mask(dims, index)  # this block's window (model.window_attn_skip_freq)
        self.mlp_norm = spec.norm(dims, tp)
        self.mlp = spec.moe(dims, tp, rng) if dims.is_moe_block(index) else spec.mlp(dims, tp, rng)
        if dims.is_moe_block(index):
            self.mlp.row = sum(dims.is_moe_block(i) for i in range(index))

    def forward(self, x: torch.Tensor, rope=None, mask: Optional[Mask] = None) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + (self.attn(h, rope) if mask is None else self.attn(h, rope, mask))
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Embedding(nn.Module):
    """Vocabulary-parallel token embedding plus learned positions (GPT-2); RoPE acts in attention."""

    def __init__(self, dims: GPTDims, tp: TPGroup, rng: Optional[TPDropoutRNG]):
        super().__init__()
        self.tp = tp
        self.head_matmul = tp.site("head")  # GPT-2's tied LM head computes through it
        self.tok = VocabParallelEmbedding(dims.padded_vocab_size, dims.hidden_size, tp)
        self.pos = nn.Embedding(dims.seq_length, dims.hidden_size) if dims.position_embedding == "learned" else None
        self.dropout = Dropout(dims.dropout, rng, split_across_tp=tp.sequence_parallel)

    def forward(self, idx: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """positions: the tokens' places in their sequence when not 0..T-1 (a context-parallel shard)."""
        x = self.tok(idx)  # (B, T, C), summed over the vocabulary shards
        if self.pos is not None:
            x = x + self.pos(positions if positions is not None else torch.arange(idx.shape[1], device=idx.device))
        if self.tp.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp.group)  # (B, T/tp, C)
        return self.dropout(x)


def run_block(block: Block, x: torch.Tensor, rope, rng: Optional[TPDropoutRNG], recompute: bool,
              mask: Optional[Mask] = None) -> torch.Tensor:
    """block(x), optionally with activation checkpointing (recompute in backward); mask: the
    block's mask for this forward (documents, its window) when it is not plain causal."""
    # the mask bound here: the paths below pass (x, rope) as they always did
    call = block if mask is None else functools.partial(block, mask=mask)
    if not recompute:
        return call(x, rope)
    if rng is None or not any(isinstance(m, Dropout) and m.p > 0 for m in block.modules()):
        return checkpointed(call, x, rope)
    # The recomputation must redraw the TP-stream dropout masks of the first pass without
    # disturbing the stream's later position (torch only restores the default generator).
    first_pass_states, calls = rng.state_dict(), [0]

    def run(x):
        calls[0] += 1
        if calls[0] == 1:
            return call(x, rope)
        now = rng.state_dict()
        rng.load_state_dict(first_pass_states)
        try:
            return call(x, rope)
        finally:
            rng.load_state_dict(now)
    return checkpointed(run, x)


def build_layer(layer: Layer, dims: GPTDims, tp: TPGroup, rng: Optional[TPDropoutRNG] = None,
                spec: BlockSpec = BlockSpec()) -> nn.Module:
    """The module of one entry of ModelSpec's layer list: the one place each kind is built, by the
    GPT, by DeepSpeed's pipeline stages and by the dry run (a tied head is the embedding again)."""
    tp = tp.for_layer(layer)  # the matmul recipe of this layer (fp8 keeps some in bf16)
    if layer.kind == "embed" or (layer.kind == "head" and dims.tie_embeddings):
        return Embedding(dims, tp, rng)
    if layer.kind == "block":
        return Block(dims, tp, rng, spec, layer.block)
    if layer.kind == "final_norm":
        return build_norm(dims, tp)
    if layer.kind == "head":
        return ColumnParallelLinear(dims.hidden_size, dims.padded_vocab_size, tp, bias=False, kind="head")
    raise ValueError(f"unknown layer kind {layer.kind!r}")


def forward_layers(owner: nn.Module, x: torch.Tensor, tokens: int, blocks, embed: Optional[nn.Module] = None,
                   final_norm: Optional[nn.Module] = None, head: Optional[nn.Module] = None,
                   tied: Optional[nn.Module] = None, token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The forward over a span of the layer list: embed (token ids in) when given, the blocks, then
    the final norm and the head (or the tied embedding `tied`) when given. The whole GPT runs every
    layer; a pipeline stage its own. `owner` holds dims, rng, rope, positions and
    activation_checkpointing; `tokens`: the sequence length the RoPE tables must cover (this rank's
    tokens, not the SP shard of them a stage passes on). With data.document_mask the token ids
    give each token's document and its place in it (model/masking.py): the first stage's input, or
    `token_ids`, the micro-batch's, handed to a later stage. Each distinct mask of the blocks is
    built once per forward (ForwardMasks)."""
    ids_in = x if embed is not None else token_ids
    if ids_in is None and owner.dims.document_mask:  # a pipeline's bug, not the user's: no silent cross-document attention
        raise ValueError("data.document_mask: a stage after the first was not handed the micro-batch's token ids")
    documents = None if ids_in is None else documents_of(ids_in, owner.dims, owner.context)
    if embed is not None:
        x = embed(x, owner.positions if documents is None else documents.positions)
    rope = None
    if owner.dims.position_embedding == "rope":  # under documents, each token's row: positions restart
        rope = owner.rope(tokens, x.device, owner.positions) if documents is None else \
            documents.rope(owner.rope(documents.length, x.device))
    masks = forward_masks(owner.dims, documents, tokens, x.device)
    for block in blocks:
        mask = None if masks is None else masks.resolve(block.attn)
        x = run_block(block, x, rope, owner.rng, owner.activation_checkpointing and owner.training, mask)
    if final_norm is not None:
        x = final_norm(x)
        x = head(x) if head is not None else tied_head_logits(tied, x)
    return x


def tied_head_logits(embedding: "Embedding", x: torch.Tensor) -> torch.Tensor:
    """GPT-2's LM head: the token embedding's vocabulary shard, used as an output projection."""
    return embedding.head_matmul.linear(embedding.tp.enter(x), embedding.tok.weight)


class GPT(nn.Module):
    """The language model: forward(idx, targets) returns the mean next-token loss (fp32)."""

    def __init__(self, dims: GPTDims, tp: TPGroup = TPGroup(), rng: Optional[TPDropoutRNG] = None,
                 activation_checkpointing: bool = False, block: BlockSpec = BlockSpec(),
                 context: Optional[ContextGroup] = None, cp_impl: str = "ring", ep: ExpertGroup = ExpertGroup()):
        super().__init__()
        self.dims, self.tp, self.rng = dims, tp, rng
        self.activation_checkpointing = activation_checkpointing
        register_positions(self, dims, context)
        self.rope = RopeTables(dims)
        spec = block.across(context, cp_impl).with_experts(ep)
        layers = layer_list(dims.num_layers, dims.tie_embeddings)
        self.embed = build_layer(layers[0], dims, tp, rng)
        self.blocks = nn.ModuleList([build_layer(layer, dims, tp, rng, spec) for layer in layers if layer.kind == "block"])
        self.moe_layers = [b.mlp for b in self.blocks if isinstance(b.mlp, MoE)]  # not a ModuleList: no new names
        self.router_stats = RouterStats(dims.num_moe_blocks)
        self.step_targets = StepTargets()  # data.eod_mask_loss: the loss per target of the global batch
        self.final_norm = build_layer(layers[-2], dims, tp)
        self.head = None if dims.tie_embeddings else build_layer(layers[-1], dims, tp)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The last block's output, before the final norm."""
        if self.positions is not None and idx.shape[1] != len(self.positions):
            raise ValueError(f"a context-parallel shard holds {len(self.positions)} tokens, got {idx.shape[1]}")
        return forward_layers(self, idx, idx.shape[1], self.blocks, embed=self.embed)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (or the tied embedding) on hidden states: this TP rank's logits."""
        x = self.final_norm(x)
        return self.head(x) if self.head is not None else tied_head_logits(self.embed, x)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss from hidden states: one region for train.compile to fuse (the
        norm, the logits' upcast and the softmax of the cross-entropy), as the blocks are."""
        # targets data.eod_mask_loss leaves out come as IGNORED_TARGET (data/dataset.py windows_batch)
        return vocab_parallel_cross_entropy(self.head_logits(x), targets, self.tp, self.embed.tok.vocab_start,
                                            self.dims.vocab_size)

    def parallel_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of the padded-vocabulary logits, (B, T, padded_vocab / tp)."""
        return self.head_logits(self.hidden_states(idx))

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Full logits over the real vocabulary, (B, T, vocab_size), gathered from the TP ranks."""
        return gather_from_tp_region(self.parallel_logits(idx), self.tp.group)[..., : self.dims.vocab_size]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.head_loss(self.hidden_states(idx), targets)
        weighed = self.step_targets.weigh(loss, targets)  # a step's or evaluation's, with data.eod_mask_loss
        if weighed is not None:
            loss = weighed
        if not self.moe_layers:
            return loss
        if self.training:
            self.router_stats.add(self.moe_layers)
        # the value stays the language-model loss; the router losses train through its gradient
        return AddAux.apply(loss, sum(layer.aux_loss for layer in self.moe_layers))

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                 seed: Optional[int] = None, eod_id: Optional[int] = None, use_cache: bool = True,
                 progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """idx (B, T) followed by up to max_new_tokens sampled tokens, with a key/value cache
        (megaframe/model/generate.py): temperature 0 or top_k 1 is greedy; seed or generator makes
        sampling reproducible; a row stops at eod_id; progress(n) after each new token."""
        from megaframe.model.generate import generate

        return generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        generator=generator, seed=seed, eod_id=eod_id, use_cache=use_cache, progress=progress)


# ---- layout-invariant initialisation ---------------------------------------------------------

def init_value(name: str, shape: tuple[int, ...], dims: GPTDims, seed: int) -> InitValue:
    """The initial value of a parameter of full (unsharded) `shape`, a pure function of its name
    and the seed, drawn only when (and where) a piece of it is asked for (model/init_values.py)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return InitValue.whole(name, shape, "zeros", 0.0, seed)
    if "norm" in name:
        return InitValue.whole(name, shape, "ones", 1.0, seed)
    std = dims.init_std
    if name.endswith(("out_proj.weight", "down_proj.weight", "experts.down_proj")):
        std = std / math.sqrt(2 * dims.num_layers)  # GPT-2: scale residual-branch outputs by depth
    return InitValue.whole(name, shape, "normal", std, seed)


def full_init_value(name: str, shape: tuple[int, ...], dims: GPTDims, seed: int) -> torch.Tensor:
    """The whole initial value of a parameter, on the host (tests and tools; training draws pieces)."""
    return init_value(name, shape, dims, seed).tensor()


def _copy_into(param: nn.Parameter, value: InitValue) -> None:
    param.copy_(value.tensor().to(param.dtype))


@torch.no_grad()
def init_parameters(module: nn.Module, prefix: str, dims: GPTDims, seed: int,
                    write: Callable[[nn.Parameter, InitValue], None] = _copy_into,
                    built_shape: Callable[[nn.Parameter], tuple[int, ...]] = lambda p: tuple(p.shape)) -> None:
    """Fill every parameter of `module` from its canonical name `prefix.local_name`.

    A parameter that is a shard carries its ShardSpec (`shard`) and full shape (`partition_shape`);
    its value is that shard of the full one, so every layout starts from one model.
    write(param, value) stores the shard's value (an InitValue, drawn when read): a copy, or the
    rank's piece of it (FSDP2's box, ZeRO-3's flat range); built_shape(param) its shape as built
    (an engine that partitions at construction leaves the parameter empty and says). A rank draws
    only the tiles its pieces overlap, never a whole parameter it does not hold.
    """
    for local_name, param in module.named_parameters():
        name = f"{prefix}.{local_name}" if prefix else local_name
        full_shape = tuple(getattr(param, "partition_shape", None) or built_shape(param))
        value = init_value(name, full_shape, dims, seed)
        shard = getattr(param, "shard", None)
        if shard is not None:
            value = shard.take(value, param.partition_index, param.partition_count)
        write(param, value)
