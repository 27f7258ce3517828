"""Text generation for megaframe's GPT: nanoGPT's `generate` with a key/value cache.

    model = megaframe.load_model("runs/char/checkpoints")
    out = model.generate(idx, max_new_tokens=200, temperature=0.8, top_k=40, seed=0)   # (B, T + new)

The prompt runs through the model once, filling each block's cache with its keys and values; every
new token then runs alone, attending to the cache, so N new tokens cost N one-token forwards instead
of N forwards of the whole context. The training forward (gpt.py) is not touched: this module walks
the same modules (embedding, each block's norms and MLP, the final norm and head), and each block's
attention runs Attention.forward_cached, its projections with the cache in between.

The context is the model's seq_length, as in training. A prompt longer than that is cropped to its
last seq_length tokens. When the context is full the window slides by one token per new token as
nanoGPT's crop does: the cache is recomputed from the last seq_length tokens (the seq_length - 1
before the newest one, plus it), so past that point each token costs one full-context forward,
and the tokens are exactly those of the full recompute (`use_cache=False`). Learned positions and
RoPE both place the window's first token at position 0, as training did.

Mixture-of-Experts blocks route dropless here (as the Hugging Face export does): with a capacity
the tokens an expert drops depend on how many run together, and a cached one-token forward would
then differ from the full recompute.
"""
from __future__ import annotations

import contextlib
import math
import dataclasses
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn


class KVCache:
    """Each block's keys and values for the tokens seen so far, (B, kv heads, seq_length, hs),
    allocated once on first use and written in place (no copy of the past per token)."""

    def __init__(self, num_layers: int, seq_length: int):
        self.seq_length = seq_length
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.length = 0  # tokens held (the position of the next one)

    def reset(self) -> None:
        """Forget every token (the buffers stay, to be overwritten)."""
        self.length = 0

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write block `layer`'s keys and values of the new tokens (B, nkv, T, hs) at positions
        length..length+T-1; return the keys and values of every position so far."""
        start, end = self.length, self.length + k.shape[2]
        if self.keys[layer] is None:
            shape = (k.shape[0], k.shape[1], self.seq_length, k.shape[3])
            self.keys[layer] = k.new_empty(shape)
            self.values[layer] = v.new_empty(shape)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def forward_cached(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The next-token logits (B, vocab_size) after `tokens` (B, T), which follow the cache's
    tokens; their keys and values join the cache."""
    dims = model.dims
    start, T = cache.length, tokens.shape[1]
    if start + T > cache.seq_length:
        raise ValueError(f"the cache holds {cache.seq_length} positions; {start + T} asked")
    positions = torch.arange(start, start + T, device=tokens.device)
    x = model.embed(tokens, positions)  # learned positions at their place in the window
    rope = None
    if dims.position_embedding == "rope":
        cos, sin = model.rope(dims.seq_length, x.device)  # the tables of positions 0..seq_length-1
        rope = cos[start:start + T], sin[start:start + T]
    for layer, block in enumerate(model.blocks):  # Block.forward, with the cache in attention
        x = x + block.attn.forward_cached(block.attn_norm(x), rope, cache, layer)
        x = x + block.mlp(block.mlp_norm(x))
    cache.length += T
    return model.head_logits(x[:, -1:])[:, -1, : dims.vocab_size]


def full_forward(model: nn.Module, context: torch.Tensor) -> torch.Tensor:
    """The next-token logits (B, vocab_size) by a forward of the whole context, no cache: the
    reference the cached path must match (and what generation costs without one)."""
    return model.head_logits(model.hidden_states(context)[:, -1:])[:, -1, : model.dims.vocab_size]


def pick_next(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
              generator: Optional[torch.Generator]) -> torch.Tensor:
    """The next token of each row, (B, 1): the argmax at temperature 0 or top_k 1; else a draw
    from softmax(logits / temperature) restricted to the top_k tokens and then to the smallest
    set whose probability reaches top_p (the most likely token always stays)."""
    # below float32's smallest normal, T became 0 in the division and 0/0 NaN (review): the limit is greedy
    if temperature < torch.finfo(torch.float32).tiny or top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    # shifted by the row's largest first (softmax's own shift): logits / 1e-40 overflowed to inf, and
    # softmax of inf is NaN (review: multinomial's traceback); (l - max) / T is at most 0 for any T > 0
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k and top_k < logits.shape[-1]:  # 0 or None: no cut
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # the mass before it already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    try:
        return torch.multinomial(probs, num_samples=1, generator=generator)
    except RuntimeError as err:  # NaN logits: "probability tensor contains either inf, nan or element < 0"
        if "probability tensor" not in str(err):
            raise
        raise ValueError("the model's next-token probabilities are not finite (its logits hold NaN or inf: "
                         "are the checkpoint's weights finite?)") from None


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Raise ValueError (one line) for settings that sample nothing sensible."""
    if not 0 <= temperature < math.inf:  # also NaN; inf divided every logit to 0: every token alike
        raise ValueError(f"temperature={temperature} must be >= 0 and finite (0 = greedy, 1 = the model's own "
                         f"distribution)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = no top-k cut)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 = no nucleus cut)")


@contextlib.contextmanager
def dropless(model: nn.Module) -> Iterator[None]:
    """Its MoE layers route without a capacity for the duration (see the module docstring)."""
    layers = [layer for layer in getattr(model, "moe_layers", []) if layer.moe.capacity_factor is not None]
    saved = [layer.moe for layer in layers]
    for layer in layers:
        layer.moe = dataclasses.replace(layer.moe, capacity_factor=None)
    try:
        yield
    finally:
        for layer, moe in zip(layers, saved):
            layer.moe = moe


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
             seed: Optional[int] = None, eod_id: Optional[int] = None, use_cache: bool = True,
             progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """idx (B, T) of token ids followed by up to max_new_tokens generated ones, (B, T + new).

    temperature 0 (or top_k 1) is greedy; else tokens are drawn with `generator`, or a generator
    seeded with `seed` (reproducible), or torch's global one. eod_id: a row that produces it stops
    there (later positions of that row repeat eod_id) and generation ends when every row has; None
    generates max_new_tokens. use_cache=False recomputes the whole context for every token.
    progress(n): called after each new token with the count so far (a tool's progress line).
    The ids are written into one (B, T + max_new_tokens) buffer made first: a size that cannot be
    held fails at once (torch.cat's growing copy cost time quadratic in the length, and failed late)."""
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if model.tp.size > 1 or model.positions is not None:
        raise ValueError("generate runs on a whole model (tp=1, no context parallelism): megaframe.load_model gives one")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx must be (batch, tokens) with at least one token, got shape {tuple(idx.shape)}")
    if generator is None and seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    window = model.dims.seq_length
    # the cached path attends to every cached key: a sliding-window model recomputes its context
    # through its cores instead (each block's window applied), slower but exact
    use_cache = use_cache and model.dims.sliding_window is None
    # room for what the run can hold: the prompt's last window and the new tokens, at most the
    # window (a 128k-context model's full-length cache is GiBs per sample for a short answer)
    room = min(window, min(idx.shape[1], window) + max_new_tokens)
    cache = KVCache(len(model.blocks), room) if use_cache else None
    out = torch.empty(idx.shape[0], idx.shape[1] + max_new_tokens, dtype=idx.dtype, device=idx.device)
    out[:, :idx.shape[1]] = idx
    length = idx.shape[1]
    pending = idx[:, -window:]  # the tokens the cache does not hold yet
    done = torch.zeros(idx.shape[0], 1, dtype=torch.bool, device=idx.device)
    was_training = model.training
    model.eval()
    try:
        with dropless(model):
            for new in range(1, max_new_tokens + 1):
                if cache is None:
                    logits = full_forward(model, out[:, max(0, length - window):length])
                else:
                    if cache.length + pending.shape[1] > window:  # full: slide by recomputing the window
                        cache.reset()
                        pending = out[:, max(0, length - window):length]
                    logits = forward_cached(model, pending, cache)
                token = pick_next(logits, temperature, top_k, top_p, generator)
                if eod_id is not None:
                    token = token.masked_fill(done, eod_id)
                    done = done | (token == eod_id)
                out[:, length:length + 1] = token
                length += 1
                pending = token
                if progress is not None:
                    progress(new)
                if eod_id is not None and bool(done.all()):  # one host read per token, as HF's generate
                    break
    finally:
        model.train(was_training)
    # a copy when it stopped early: the view would keep the whole B x (T + max_new_tokens) buffer alive
    return out if length == out.shape[1] else out[:, :length].clone()
