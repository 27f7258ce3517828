"""Context parallelism: causal attention over a sequence split across the cp ranks.

Zig-zag sharding: a sequence of T tokens is cut into 2*cp chunks of c = T / (2*cp), and cp rank i
holds chunks i and 2*cp-1-i, back to back (2c tokens, positions still increasing). Under a causal
mask an early chunk has little to attend to and a late one much; pairing them gives every rank the
same work.

Two ways to attend across the cp ranks: ring attention (parallel/ring.py), in which the K/V blocks
travel around the cp group, and Ulysses (here): an all-to-all turns sequence-sharded q/k/v into
head-sharded, full-length q/k/v, attention runs locally, and a second all-to-all turns the result
back. Ulysses needs cp to divide the number of kv heads. Both keep grouped-query attention's kv
heads as they are: what travels carries num_kv_heads, not num_heads.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaframe.parallel.mappings import gather_values

__all__ = ["AttentionDropout", "ContextGroup", "attention_allowed", "gather_sequence", "kv_heads_for_mask",
           "ulysses_attention", "zigzag_positions", "zigzag_shard", "zigzag_unshard"]


@dataclass(frozen=True)
class ContextGroup:
    """The cp ranks of this rank's sequence: the process group, its global ranks in cp order, and
    this rank's place among them."""

    group: Optional[object]
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout on the attention probabilities of the ring's blocks. Each block's keep mask is drawn
    from its own generator, seeded from `seed` (drawn per layer call from the rank's dropout stream),
    the cp rank, the ring step and the query tile, so the backward redraws exactly the forward's
    masks without keeping them."""

    p: float
    seed: int

    def keep(self, cp_rank: int, step: int, tile_start: int, shape: tuple[int, ...],
             device: torch.device, col_start: int = 0) -> torch.Tensor:
        """The keep mask (True: kept) of one block tile (col_start: where a masked ring's piece
        starts among the block's keys)."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.tile_seed(cp_rank, step, tile_start, col_start))
        return torch.rand(shape, generator=generator, device=device) >= self.p

    def tile_seed(self, cp_rank: int, step: int, tile_start: int, col_start: int = 0) -> int:
        """A hash of (seed, cp rank, step, tile): no two tiles of a call share a generator seed,
        however long the shard (an arithmetic mix would wrap at some tile offset)."""
        key = f"{self.seed}:{cp_rank}:{step}:{tile_start}" + (f":{col_start}" if col_start else "")
        key = key.encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


# ---- zig-zag layout --------------------------------------------------------------------------
def _chunk_length(seq_length: int, cp: int) -> int:
    if seq_length % (2 * cp):
        raise ValueError(f"model.seq_length={seq_length} must be divisible by 2*parallel.cp={2 * cp} "
                         f"(zig-zag sharding cuts each sequence into 2*cp chunks)")
    return seq_length // (2 * cp)


def zigzag_positions(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens cp rank `cp_rank` holds (for RoPE), in local order."""
    c = _chunk_length(seq_length, cp)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def zigzag_shard(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's chunks (cp_rank and 2*cp-1-cp_rank) of a full-length tensor, along `dim`."""
    c = _chunk_length(x.shape[dim], cp)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([x.narrow(dim, first, c), x.narrow(dim, second, c)], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full-length tensor from every cp rank's shard, in cp order (the inverse of zigzag_shard)."""
    cp = len(shards)
    c = shards[0].shape[dim] // 2
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        chunks[rank], chunks[2 * cp - 1 - rank] = shard.narrow(dim, 0, c), shard.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def gather_sequence(x: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    """The whole sequence (B, T) of every cp rank's zig-zag shard x (B, 2c), in natural order, on
    every cp rank: one all-gather of a value no gradient flows to (the token ids, so each rank finds
    the documents of the whole row once per forward; model/masking.py)."""
    gathered = gather_values(x, 0, cp.group)  # (cp * B, 2c): rank r's shard in rows [r*B, (r+1)*B)
    return zigzag_unshard(list(gathered.chunk(cp.size, dim=0)), dim=1)


# ---- masks -------------------------------------------------------------------------------------
def attention_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int] = None,
                      q_ids: Optional[torch.Tensor] = None, k_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """True where a query may see a key: causal over the global positions q_pos (Tq,) and k_pos
    (Tk,), within `window` keys (itself included) when given, and within its document when the
    document ids q_ids (B, Tq) and k_ids (B, Tk) are given. (1 or B, Tq, Tk), made on the device
    from index comparisons (no host tensor, no sync)."""
    distance = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # (Tq, Tk)
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    allowed = allowed.unsqueeze(0)  # (1, Tq, Tk)
    if q_ids is not None:
        allowed = allowed & (q_ids.unsqueeze(2) == k_ids.unsqueeze(1))  # (B, Tq, Tk)
    return allowed


def kv_heads_for_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with as many heads as q, for an SDPA call with an attn_mask. On CUDA no fused kernel
    takes a mask and grouped kv heads together (FlashAttention takes no mask; memory-efficient
    attention, which takes masks, no GQA: torch's SDPA docs), so enable_gqa with a mask ran the math
    kernel, whose (B, H, T, T) fp32 scores are GiBs a layer at 8k tokens. Repeated heads cost
    (B, H, T, D) each and keep the memory-efficient kernel eligible."""
    if k.shape[1] == q.shape[1]:
        return k, v
    repeats = q.shape[1] // k.shape[1]
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


# ---- Ulysses --------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """to_heads: (B, H, T/cp, D) sharded by sequence -> (B, H/cp, T, D) sharded by heads (the cp
    ranks' shards concatenated along the sequence in cp order), by one all-to-all; otherwise the
    reverse. Backward is the other direction."""

    @staticmethod
    def forward(ctx, x, cp: ContextGroup, to_heads: bool):
        ctx.cp, ctx.to_heads = cp, to_heads
        return _seq_to_heads(x, cp) if to_heads else _heads_to_seq(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq(grad, ctx.cp) if ctx.to_heads else _seq_to_heads(grad, ctx.cp)), None, None


def _seq_to_heads(x: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    B, H, t, D = x.shape
    send = x.reshape(B, cp.size, H // cp.size, t, D).transpose(0, 1).contiguous()  # head group j -> rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=cp.group)  # received[i]: rank i's tokens of my heads
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // cp.size, cp.size * t, D)


def _heads_to_seq(x: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    B, h, T, D = x.shape
    send = x.reshape(B, h, cp.size, T // cp.size, D).permute(2, 0, 1, 3, 4).contiguous()  # tokens of rank i
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=cp.group)  # received[j]: head group j of my tokens
    return received.transpose(0, 1).reshape(B, cp.size * h, T // cp.size, D)


_ORDERS: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _zigzag_order(seq_length: int, cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, natural): the position of each token of the cp ranks' shards laid end to end, and
    its inverse permutation. Made once per shape and device, not in every forward."""
    key = (seq_length, cp, str(device))
    if key not in _ORDERS:
        order = torch.cat([zigzag_positions(seq_length, cp, r) for r in range(cp)]).to(device)
        _ORDERS[key] = (order, torch.argsort(order))
    return _ORDERS[key]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup,
                      scale: Optional[float] = None, dropout: Optional[AttentionDropout] = None,
                      documents: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard by all-to-all over heads: q (B, H, 2c, D), k
    and v (B, Hkv, 2c, D); cp must divide Hkv. Returns (B, H, 2c, D). dropout: SDPA's own, on this
    rank's heads, from the generator the caller has made current (its seed is not used). documents:
    the (B, T) document ids of the whole sequence, window: keys per query; either restricts the
    causal mask, applied to the full sequence of this rank's head group as one boolean mask."""
    if k.shape[1] % cp.size:
        raise ValueError(f"parallel.cp={cp.size} must divide the {k.shape[1]} kv heads for parallel.cp_impl=ulysses; "
                         f"use parallel.cp_impl=ring")
    qh, kh, vh = (_AllToAll.apply(t, cp, True) for t in (q, k, v))  # full length, in zig-zag order
    order, natural = _zigzag_order(qh.shape[2], cp.size, q.device)
    mask = {}
    if documents is not None or window is not None:  # natural order: positions 0..T-1
        positions = torch.arange(qh.shape[2], device=q.device)
        mask = {"attn_mask": attention_allowed(positions, positions, window, documents, documents).unsqueeze(1)}
    qn, kn, vn = qh[:, :, natural], kh[:, :, natural], vh[:, :, natural]
    if mask:
        kn, vn = kv_heads_for_mask(qn, kn, vn)
    y = F.scaled_dot_product_attention(qn, kn, vn, is_causal=not mask, scale=scale,
                                       enable_gqa=qn.shape[1] != kn.shape[1],
                                       dropout_p=0.0 if dropout is None else dropout.p, **mask)
    return _AllToAll.apply(y[:, :, order], cp, False)
