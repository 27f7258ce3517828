"""GPTDims: the resolved model shape. Free of torch, so that the CLI, the validator and the planner
can reason about shapes without paying torch's import time in the launching process."""
from __future__ import annotations

from dataclasses import dataclass

from megaframe.config.schema import ModelConfig
from megaframe.config.validate import ffn_hidden_size, padded_vocab_size


@dataclass(frozen=True)
class GPTDims:
    """Resolved model shape: everything the modules need, with derived values filled in."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int  # the tokenizer's vocabulary: logits beyond it are dropped
    padded_vocab_size: int  # rows in the embedding / LM head (Megatron padding)
    seq_length: int
    norm: str
    norm_eps: float
    activation: str
    position_embedding: str
    rope_theta: float
    tie_embeddings: bool
    bias: bool
    dropout: float
    init_std: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


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
