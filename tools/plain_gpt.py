"""The script a user writes instead of a framework: a GPT in the shape of nanoGPT's model and train.py
loop, in one file that imports only torch and numpy. tools/bench.py times megaframe against it.

usage: python tools/plain_gpt.py TOKENS.bin [--dtype uint16] [--layers 4] [--hidden 128] [--heads 4]
           [--seq 128] [--batch 8] [--accum 2] [--steps 1] [--gelu tanh|none] [--bias] [--lr 1e-3]

Prints one JSON line on stdout after the last step: the wall-clock time (time.time()) at which
the first step ended, so a caller that noted the time before starting this process has the
launch-to-first-step time, and the tokens/s of the steps after the first.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)  # one matmul for q, k and v
        self.proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool, gelu: str):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden, bias=bias), nn.LayerNorm(hidden, bias=bias)
        self.attn = SelfAttention(hidden, heads, bias)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden, bias=bias), nn.Linear(4 * hidden, hidden, bias=bias)
        self.gelu = gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate=self.gelu))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, hidden: int, heads: int, bias: bool, gelu: str):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads, bias, gelu) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden, bias=bias)
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # GPT-2's init: N(0, 0.02), residual outputs scaled by depth
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)  # tied head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens")
    parser.add_argument("--dtype", default="uint16")
    parser.add_argument("--vocab", type=int, default=257)
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 4), ("seq", 128), ("batch", 8), ("accum", 2),
                          ("steps", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--gelu", choices=["tanh", "none"], default="tanh")
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    data = np.memmap(args.tokens, dtype=args.dtype, mode="r")
    torch.manual_seed(1337)
    model = GPT(args.vocab, args.seq, args.layers, args.hidden, args.heads, args.bias, args.gelu)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))

    def get_batch():
        ix = torch.randint(len(data) - args.seq, (args.batch,))
        x = torch.stack([torch.from_numpy(data[i:i + args.seq].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.seq].astype(np.int64)) for i in ix])
        return x, y

    first_step_at, started = None, None
    for _ in range(args.steps):
        for _ in range(args.accum):
            loss = model(*get_batch()) / args.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"loss {loss.item() * args.accum:.4f}", flush=True)
        if first_step_at is None:
            first_step_at = started = time.time()
    later = args.steps - 1
    tokens_per_s = later * args.accum * args.batch * args.seq / (time.time() - started) if later else None
    print(json.dumps({"first_step_at": first_step_at, "tokens_per_s": tokens_per_s}), flush=True)


if __name__ == "__main__":
    main()
