"""build_model(): resolves the config into GPTDims and builds an initialised model."""
from __future__ import annotations

import math

import torch.nn as nn

from megaframe.config.schema import ModelConfig
from megaframe.config.validate import ffn_hidden_size, padded_vocab_size
from megaframe.model.gpt import GPT, GPTDims, init_parameters
from megaframe.parallel.random import TPDropoutRNG
from megaframe.parallel.state import ParallelState


def resolve_dims(cfg: ModelConfig, tokenizer_vocab_size: int, tp: int = 1) -> GPTDims:
    """Fill derived values: kv heads, MLP width, real and padded vocabulary."""
    vocab = cfg.vocab_size if cfg.vocab_size is not None else tokenizer_vocab_size
    return GPTDims(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_kv_heads or cfg.num_attention_heads,
        ffn_hidden_size=ffn_hidden_size(cfg),
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab, cfg.make_vocab_size_divisible_by, tp),
        seq_length=cfg.seq_length,
        norm=cfg.norm,
        norm_eps=cfg.norm_eps,
        activation=cfg.activation,
        position_embedding=cfg.position_embedding,
        rope_theta=cfg.rope_theta,
        tie_embeddings=cfg.tie_embeddings,
        bias=cfg.bias,
        dropout=cfg.dropout,
        init_std=cfg.init_std,
    )


def build_model(dims: GPTDims, ps: ParallelState, seed: int, activation_checkpointing: bool = False,
                sequence_parallel: bool = False) -> nn.Module:
    """An initialised GPT holding this rank's tensor-parallel shard (pipeline stages: not yet)."""
    if ps.pp != 1:
        raise NotImplementedError("pipeline-parallel models are not built by this version")
    model = GPT(dims, tp=ps.tp_region(sequence_parallel), rng=TPDropoutRNG(seed, ps.tp_rank),
                activation_checkpointing=activation_checkpointing)
    init_parameters(model, "", dims, seed)
    return model


def count_parameters(model: nn.Module, full: bool = False) -> int:
    """Parameters of this rank's module (ZeRO-3-partitioned ones at their gathered size);
    full=True counts tensor-parallel shards at their unsharded size, i.e. the whole model."""
    total = 0
    for p in model.parameters():
        shape = getattr(p, "partition_shape", None) if full else None
        total += math.prod(shape) if shape else getattr(p, "ds_numel", p.numel())
    return total
