"""The dense MLP of a block and the dropout that knows which RNG stream to draw from: used by GPT's
blocks (gpt.py) and by MoE's shared experts (moe.py)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaframe.model.dims import GPTDims
from megaframe.parallel.layers import ColumnParallelLinear, RowParallelLinear, TPGroup
from megaframe.parallel.random import TPDropoutRNG


class Dropout(nn.Module):
    """Dropout drawing from the per-TP-rank stream when its input differs across TP ranks."""

    def __init__(self, p: float, rng: Optional[TPDropoutRNG], split_across_tp: bool):
        super().__init__()
        self.p, self.rng, self.split = p, rng, split_across_tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.split and self.rng is not None:
            with self.rng.fork():
                return F.dropout(x, self.p, training=True)
        return F.dropout(x, self.p, training=True)


def gelu(x: torch.Tensor, activation: str) -> torch.Tensor:
    """model.activation=gelu: the tanh approximation GPT-2 trained with ("gelu_new"); gelu_exact: the
    erf form (nanoGPT, Megatron's default), which torch's CPU kernel computes ~4x faster."""
    return F.gelu(x, approximate="tanh" if activation == "gelu" else "none")


class MLP(nn.Module):
    """GELU MLP (GPT-2) or SwiGLU (Llama): column-parallel up/gate, row-parallel down."""

    def __init__(self, dims: GPTDims, tp: TPGroup, rng: Optional[TPDropoutRNG]):
        super().__init__()
        self.tp = tp
        self.activation = dims.activation
        self.swiglu = dims.activation == "swiglu"
        self.up_proj = ColumnParallelLinear(dims.hidden_size, dims.ffn_hidden_size, tp, dims.bias, enter=False)
        if self.swiglu:
            self.gate_proj = ColumnParallelLinear(dims.hidden_size, dims.ffn_hidden_size, tp, dims.bias, enter=False)
        self.down_proj = RowParallelLinear(dims.ffn_hidden_size, dims.hidden_size, tp, dims.bias)
        self.dropout = Dropout(dims.dropout, rng, split_across_tp=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp.enter(x)
        if self.swiglu:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, ffn/tp)
        else:
            h = gelu(self.up_proj(x), self.activation)
        return self.dropout(self.down_proj(h))
