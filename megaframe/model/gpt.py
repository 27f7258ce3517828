"""GPT in two flavours, chosen by config: GPT-2 (LayerNorm, GELU, learned positions, tied
embeddings) and Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head).

Reads top to bottom like nanoGPT. Parallelism stays outside: blocks are built from plain layers
here; tensor-parallel variants replace them through the factory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama): no mean subtraction, no bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability under bf16, as Llama does
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def build_norm(dims: GPTDims) -> nn.Module:
    """LayerNorm or RMSNorm as the config says."""
    if dims.norm == "rmsnorm":
        return RMSNorm(dims.hidden_size, dims.norm_eps)
    return nn.LayerNorm(dims.hidden_size, eps=dims.norm_eps, bias=dims.bias)


def rope_tables(dims: GPTDims, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (T, hs), in the rotate-half layout Hugging Face's Llama uses."""
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, dims.head_dim, 2, device=device).float() / dims.head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, nh, T, hs) query/key vectors by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query heads and RoPE."""

    def __init__(self, dims: GPTDims):
        super().__init__()
        self.dims = dims
        hs = dims.head_dim
        self.q_proj = nn.Linear(dims.hidden_size, dims.num_heads * hs, bias=dims.bias)
        self.k_proj = nn.Linear(dims.hidden_size, dims.num_kv_heads * hs, bias=dims.bias)
        self.v_proj = nn.Linear(dims.hidden_size, dims.num_kv_heads * hs, bias=dims.bias)
        self.out_proj = nn.Linear(dims.num_heads * hs, dims.hidden_size, bias=dims.bias)
        self.resid_dropout = nn.Dropout(dims.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        hs = self.dims.head_dim
        q = self.q_proj(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, -1, hs).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group of q heads
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dims.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """GELU MLP (GPT-2) or SwiGLU (Llama)."""

    def __init__(self, dims: GPTDims):
        super().__init__()
        self.swiglu = dims.activation == "swiglu"
        self.up_proj = nn.Linear(dims.hidden_size, dims.ffn_hidden_size, bias=dims.bias)
        if self.swiglu:
            self.gate_proj = nn.Linear(dims.hidden_size, dims.ffn_hidden_size, bias=dims.bias)
        self.down_proj = nn.Linear(dims.ffn_hidden_size, dims.hidden_size, bias=dims.bias)
        self.dropout = nn.Dropout(dims.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = F.gelu(self.up_proj(x), approximate="tanh")  # GPT-2's "gelu_new"
        return self.dropout(self.down_proj(h))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dims: GPTDims):
        super().__init__()
        self.attn_norm = build_norm(dims)
        self.attn = Attention(dims)
        self.mlp_norm = build_norm(dims)
        self.mlp = MLP(dims)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Embedding(nn.Module):
    """Token embedding plus learned positions (GPT-2) or nothing (RoPE acts inside attention)."""

    def __init__(self, dims: GPTDims):
        super().__init__()
        self.tok = nn.Embedding(dims.padded_vocab_size, dims.hidden_size)
        self.pos = nn.Embedding(dims.seq_length, dims.hidden_size) if dims.position_embedding == "learned" else None
        self.dropout = nn.Dropout(dims.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)  # (B, T, C)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.dropout(x)


class GPT(nn.Module):
    """The language model: forward(idx, targets) returns the mean next-token loss (fp32)."""

    def __init__(self, dims: GPTDims, activation_checkpointing: bool = False):
        super().__init__()
        self.dims = dims
        self.activation_checkpointing = activation_checkpointing
        self.embed = Embedding(dims)
        self.blocks = nn.ModuleList([Block(dims) for _ in range(dims.num_layers)])
        self.final_norm = build_norm(dims)
        self.head = None if dims.tie_embeddings else nn.Linear(dims.hidden_size, dims.padded_vocab_size, bias=False)
        if dims.position_embedding == "rope":
            cos, sin = rope_tables(dims, dims.seq_length)
            # not parameters and not in checkpoints: a pure function of the config
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary, (B, T, vocab_size); padded rows are dropped."""
        x = self.embed(idx)
        rope = (self.rope_cos.to(x.dtype), self.rope_sin.to(x.dtype)) if self.dims.position_embedding == "rope" else None
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        x = self.final_norm(x)
        weight = self.embed.tok.weight if self.head is None else self.head.weight
        logits = F.linear(x, weight)
        return logits[..., : self.dims.vocab_size]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---- layout-invariant initialisation ---------------------------------------------------------

def _name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (run seed, parameter name); Python's hash() is salted per process."""
    import hashlib

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init_value(name: str, shape: tuple[int, ...], dims: GPTDims, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of a parameter, a pure function of its name and the seed."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    std = dims.init_std
    if name.endswith(("out_proj.weight", "down_proj.weight")):
        std = std / math.sqrt(2 * dims.num_layers)  # GPT-2: scale residual-branch outputs by depth
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_parameters(module: nn.Module, prefix: str, dims: GPTDims, seed: int) -> None:
    """Fill every parameter of `module` from its canonical name `prefix.local_name`.

    A parameter that is a shard carries `partition_dim` and `partition_shape` (the full shape);
    the full value is generated and the shard sliced out, so every layout starts from one model.
    """
    for local_name, param in module.named_parameters():
        name = f"{prefix}.{local_name}" if prefix else local_name
        full_shape = tuple(getattr(param, "partition_shape", param.shape))
        value = full_init_value(name, full_shape, dims, seed)
        dim = getattr(param, "partition_dim", None)
        if dim is not None:
            value = value.chunk(param.partition_count, dim=dim)[param.partition_index]
        param.copy_(value.to(param.dtype))
