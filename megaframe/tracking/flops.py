"""Model FLOPs per token (PaLM, appendix B): 6·N + 12·L·h·s."""
from __future__ import annotations

from megaframe.model.gpt import GPTDims


def matmul_parameters(dims: GPTDims) -> int:
    """N of the PaLM formula: every parameter that takes part in a matmul per token.

    The input embedding tables are lookups, not matmuls, so they are excluded; the LM head is a
    matmul over the (padded) vocabulary even when its weight is tied to the input embedding.
    """
    h, f, hs = dims.hidden_size, dims.ffn_hidden_size, dims.head_dim
    attn = h * dims.num_heads * hs + 2 * h * dims.num_kv_heads * hs + dims.num_heads * hs * h
    mlp = (3 if dims.activation == "swiglu" else 2) * h * f
    return dims.num_layers * (attn + mlp) + dims.padded_vocab_size * h


def flops_per_token(dims: GPTDims, seq_length: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), attention scores included."""
    s = seq_length or dims.seq_length
    return 6.0 * matmul_parameters(dims) + 12.0 * dims.num_layers * dims.hidden_size * s
