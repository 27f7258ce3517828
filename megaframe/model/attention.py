"""The attention core: softmax(q k^T / sqrt(hs) + mask) v, one implementation per run.

A block projects x into q, k and v and calls its core with them and a Mask; which core that is
(SDPA on one rank's heads, or ring or Ulysses attention across the context-parallel ranks) is
chosen once, by build_attention_core, from the config (model.dropout) and the layout (cp, cp_impl).
Each core owns its attention dropout and the random stream it draws from, so the block has no
branch and a new variant (a masked ring, a varlen kernel) is one more core here plus its line in
build_attention_core. model.attention_core picks SDPA or FlexAttention (FlexCore) without context
parallelism (model/dims.py resolves auto: sdpa until flex has run on a GPU).

Shapes, as nanoGPT writes them: q (B, nh, T, hs); k and v (B, nkv, T, hs), where nkv divides nh
(grouped-query attention; the SDPA core is told whether SDPA may repeat the kv heads itself, the
cp cores expand them); the output (B, nh, T, hs). Under context parallelism T is this rank's
zig-zag shard (parallel/context.py).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaframe.parallel.context import AttentionDropout, ContextGroup, kv_heads_for_mask, ulysses_attention
from megaframe.parallel.random import TPDropoutRNG
from megaframe.parallel.ring import ring_attention

__all__ = ["CAUSAL", "AttentionCore", "FlexCore", "Mask", "RingCore", "SDPACore", "SDPA_HAS_GQA", "UlyssesCore",
           "build_attention_core", "decode_attention"]

# torch >= 2.5 lets SDPA serve several query heads from one kv head without copying k and v
SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@dataclass(frozen=True, eq=False)
class Mask:
    """Which keys each query may see; every field's default means "no restriction", so a Mask()
    is plain causal attention and every core keeps its fast path for it:
      - causal: a query sees no later key;
      - documents: (B, T) document ids per token (model/masking.py computes them on the device from
        the tokens and the end-of-document id): a query sees only keys of its own document
        (Megatron's reset_attention_mask). T is the whole sequence attention runs over: this rank's
        tokens for SDPA, the whole row (every cp rank's tokens, in natural order) for the cp cores;
      - window: a query sees only the last `window` keys, itself included (Mistral's sliding
        window, transformers' convention); a per-layer pattern is no field: each block holds its
        own Mask (model/masking.py's layer_mask).
    A core that cannot apply a mask says so in `supports`; validation refuses such a run before
    launch (config/attention_rules.py). Compared by identity (eq=False): a mask may hold a tensor.
    `dense`: allowed()'s tensor when a core's `prepare` built it once for every block of a forward
    that shares this mask (model/masking.py's ForwardMasks), else None; `blocks`: FlexCore's BlockMask,
    built the same way.
    """

    causal: bool = True
    documents: Optional[torch.Tensor] = field(default=None, repr=False)
    window: Optional[int] = None
    dense: Optional[torch.Tensor] = field(default=None, repr=False)
    blocks: Optional[Any] = field(default=None, repr=False)

    def restricts(self, length: int) -> bool:
        """Whether over `length` keys this mask restricts more than `causal` does: documents, or a
        window shorter than the sequence (W >= T is no window, bitwise)."""
        return self.documents is not None or (self.window is not None and self.window < length)

    def allowed(self, length: int, device) -> torch.Tensor:
        """The boolean mask SDPA takes, True where a query may see a key: (1 or B, 1, T, T), built on
        the device from index comparisons (no host tensor, no sync)."""
        query = torch.arange(length, device=device).unsqueeze(1)  # (T, 1)
        key = torch.arange(length, device=device).unsqueeze(0)  # (1, T)
        allowed = key <= query if self.causal else torch.ones(length, length, dtype=torch.bool, device=device)
        if self.window is not None:
            allowed = allowed & (query - key < self.window)
        allowed = allowed.unsqueeze(0)  # (1, T, T)
        if self.documents is not None:
            allowed = allowed & (self.documents.unsqueeze(2) == self.documents.unsqueeze(1))  # (B, T, T)
        return allowed.unsqueeze(1)  # (1 or B, 1, T, T): every head the same


CAUSAL = Mask()


class AttentionCore(Protocol):
    """What a block calls: core(q, k, v, mask) -> y, shapes as in the module docstring. A core is
    an nn.Module without parameters, so model.train()/eval() switches its dropout."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor: ...

    def supports(self, mask: Mask) -> bool: ...

    def prepare(self, mask: Mask, length: int, device) -> Mask:
        """The mask as this core takes it, built once per forward for all blocks that share it."""


class SDPACore(nn.Module):
    """torch's scaled_dot_product_attention on this rank's heads (no context parallelism).

    Attention dropout acts on this rank's heads only, so under tensor parallelism it draws from the
    rank's own stream (parallel/random.py's fork); without that stream, from torch's default one."""

    def __init__(self, p: float, rng: Optional[TPDropoutRNG], gqa: bool):
        super().__init__()
        self.p, self.rng = p, rng
        self.gqa = {"enable_gqa": True} if gqa else {}  # SDPA repeats the kv heads itself

    def supports(self, mask: Mask) -> bool:
        return True  # any Mask, as a boolean attn_mask

    def prepare(self, mask: Mask, length: int, device) -> Mask:
        """The mask with its dense form built (on the device) when it restricts more than causal."""
        if not mask.restricts(length) or mask.dense is not None:
            return mask
        return Mask(mask.causal, mask.documents, mask.window, dense=mask.allowed(length, device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        p = self.p if self.training else 0.0
        T = q.shape[2]
        # an unrestricted mask keeps SDPA's is_causal path (its curves unchanged bitwise); other
        # masks go in as a dense boolean mask: exact in fp32 (masked scores are -inf, their weights
        # exact zeros), on every device and dtype, with no compile step. FlexAttention's block
        # masks skip the empty tiles on GPUs; that is a core of its own (issue 54, item 1)
        dense = mask.dense if mask.dense is not None else mask.allowed(T, q.device) if mask.restricts(T) else None
        masked = {} if dense is None else {"attn_mask": dense}
        causal = not masked and mask.causal
        gqa = self.gqa
        if masked and gqa:
            (k, v), gqa = kv_heads_for_mask(q, k, v), {}
        if p and self.rng is not None:
            with self.rng.fork():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p, **masked, **gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p, **masked, **gqa)


def _flex_functions(device_type: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """flex_attention and create_block_mask for a device: compiled on CUDA (eager flex_attention is
    torch's slow reference there, and an uncompiled create_block_mask materialises the (B, T, T)
    mask), eager on the CPU (tests; torch has no CPU backward for flex: the config refuses training
    with it there, config/attention_rules.py). Inside a compiled region (train.compile) the plain
    functions: dynamo compiles flex itself, and a torch.compile call is not traced."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if device_type != "cuda" or torch.compiler.is_compiling():
        return flex_attention, create_block_mask
    return _compiled_flex(), _compiled_block_mask()


@functools.lru_cache(maxsize=None)
def _compiled_flex() -> Callable[..., Any]:
    """torch.compile(flex_attention), compiled once per process (per shape, by torch's own cache)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=None)
def _compiled_block_mask() -> Callable[..., Any]:
    """torch.compile(create_block_mask), as torch asks: its _compile=True flag, which did the same per
    call, is deprecated (a DeprecationWarning at every mask built) and to be removed."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _mask_mod(mask: Mask) -> Callable[..., torch.Tensor]:
    """The mask as FlexAttention's mask_mod(b, h, q, kv) -> bool: Mask.allowed's rule, per index."""
    documents, window, causal = mask.documents, mask.window, mask.causal

    def allowed(b, h, q, kv):
        ok = kv <= q if causal else q >= 0  # q >= 0: an all-true tensor of the index's kind
        if window is not None:
            ok = ok & (q - kv < window)
        if documents is not None:
            ok = ok & (documents[b, q] == documents[b, kv])
        return ok

    return allowed


class FlexCore(nn.Module):
    """model.attention_core=flex: torch's FlexAttention with a block mask, which skips the tiles a
    document or window mask leaves empty, where SDPA with a dense mask loses its flash kernel and
    computes every tile. A mask that restricts nothing beyond causal keeps SDPA's is_causal path (the
    flash kernel is as fast as flex there, and the curves stay SDPACore's, bitwise). No attention
    dropout (FlexAttention has none): the config refuses model.dropout > 0 with it."""

    def __init__(self, p: float):
        super().__init__()
        if p:
            raise ValueError(f"FlexCore has no attention dropout (model.dropout={p}); use model.attention_core=sdpa")

    def supports(self, mask: Mask) -> bool:
        return True  # any Mask, as a mask_mod

    def prepare(self, mask: Mask, length: int, device) -> Mask:
        """The mask with its BlockMask built, once per forward for every block that shares it. On CUDA
        create_block_mask runs on the device (a compiled kernel over the index grid, then sorts and
        sums to list each query tile's non-empty key tiles): no host tensor and no host read."""
        if not mask.restricts(length) or mask.blocks is not None:
            return mask
        device = torch.device(device)
        batch = None if mask.documents is None else mask.documents.shape[0]
        blocks = _flex_functions(device.type)[1](_mask_mod(mask), batch, None, length, length, device=device)
        return Mask(mask.causal, mask.documents, mask.window, blocks=blocks)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        T = q.shape[2]
        if not mask.restricts(T):  # SDPACore's own call, bitwise
            return F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal,
                                                  **({"enable_gqa": True} if k.shape[1] != q.shape[1] else {}))
        blocks = mask.blocks if mask.blocks is not None else self.prepare(mask, T, q.device).blocks
        flex = _flex_functions(q.device.type)[0]
        return flex(q, k, v, block_mask=blocks, enable_gqa=k.shape[1] != q.shape[1])


class _ContextCore(nn.Module):
    """Causal attention across the cp ranks of `context`, through `kernel` (ring or Ulysses), with
    the mask's documents (ids of the whole row) and window.

    With dropout, the rank's own stream (it differs by tp and cp rank) draws one seed per call: the
    ring seeds its tile masks from it; Ulysses' SDPA draws its masks from the same forked stream."""

    kernel: Callable[..., torch.Tensor]

    def __init__(self, p: float, rng: Optional[TPDropoutRNG], context: ContextGroup):
        super().__init__()
        self.p, self.rng, self.context = p, rng, context

    def supports(self, mask: Mask) -> bool:
        # documents and windows restrict a causal mask; the zig-zag layout and the ring's skipped
        # pieces assume causal attention underneath
        return mask.causal

    def prepare(self, mask: Mask, length: int, device) -> Mask:
        return mask  # the kernels take the mask's fields, no dense form

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        if not self.supports(mask):
            raise ValueError(f"{type(self).__name__} attends causally only; it cannot apply {mask}")
        kernel = type(self).kernel
        # W >= T is no window: the plain causal kernels, bitwise
        masked = {"documents": mask.documents, "window": mask.window} if mask.restricts(q.shape[2] * self.context.size) \
            else {}
        if not (self.p if self.training else 0.0):
            return kernel(q, k, v, self.context, **masked)
        with self.rng.fork() if self.rng is not None else contextlib.nullcontext():
            dropout = AttentionDropout(self.p, seed=int(torch.randint(0, 1 << 62, ())))  # a CPU draw: no device sync
            return kernel(q, k, v, self.context, dropout=dropout, **masked)


class RingCore(_ContextCore):
    """parallel.cp_impl=ring: K/V blocks travel around the cp ranks (parallel/ring.py)."""

    kernel = staticmethod(ring_attention)


class UlyssesCore(_ContextCore):
    """parallel.cp_impl=ulysses: all-to-all to head shards, SDPA on full length (parallel/context.py)."""

    kernel = staticmethod(ulysses_attention)


_CP_CORES: dict[str, type[_ContextCore]] = {"ring": RingCore, "ulysses": UlyssesCore}


def build_attention_core(dropout: float, rng: Optional[TPDropoutRNG], gqa: bool,
                         context: Optional[ContextGroup] = None, cp_impl: str = "ring",
                         kind: str = "sdpa") -> nn.Module:
    """The run's attention core, the one place it is chosen: without context parallelism (context
    None) SDPA or FlexAttention (kind: GPTDims.attention_core, model.attention_core resolved), else
    the parallel.cp_impl one. dropout: model.dropout (applied in training only); rng: the per-TP-rank
    dropout stream (None at tp=1); gqa: whether SDPA may repeat kv heads."""
    if context is None:
        return FlexCore(dropout) if kind == "flex" else SDPACore(dropout, rng, gqa)
    if cp_impl not in _CP_CORES:
        raise ValueError(f"parallel.cp_impl={cp_impl!r} is not one of {sorted(_CP_CORES)}")
    return _CP_CORES[cp_impl](dropout, rng, context)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, gqa: bool) -> torch.Tensor:
    """Attention of T new queries q (B, nh, T, hs) to the key/value cache plus themselves, k and v
    (B, nh or nkv, past + T, hs): generation's path (model/generate.py), one rank, no dropout,
    whichever core trained the model. Not a core call because its causal mask is aligned to the
    end (the queries sit at positions past..past+T-1), which SDPA's is_causal is not."""
    extra = {"enable_gqa": True} if gqa else {}
    if past == 0:  # the prompt: causal, as in training
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    # one new token sees every key; a block of them sees the cache and its own past
    mask = None if q.shape[2] == 1 else torch.ones(q.shape[2], past + q.shape[2], dtype=torch.bool,
                                                   device=q.device).tril(past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
