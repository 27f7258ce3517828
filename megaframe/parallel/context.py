"""Context parallelism: causal attention over a sequence split across the cp ranks.

Zig-zag sharding: a sequence of T tokens is cut into 2*cp chunks of c = T / (2*cp), and cp rank i
holds chunks i and 2*cp-1-i, back to back (2c tokens, positions still increasing). Under a causal
mask an early chunk has little to attend to and a late one much; pairing them gives every rank the
same work.

Ring attention (ring_attention): each rank keeps its queries; the K/V blocks travel around the cp
group, one hop per step, the next transfer running while the current block is computed. Each block's
partial result is merged into the running one with its log-sum-exp, so the result is exactly
softmax attention over the whole sequence. Which part of a block is needed follows from the chunk
positions (rank r receiving the block of rank s):
  s == r  all local queries, all local keys, causal (the local positions increase);
  s <  r  all local queries, the block's first chunk only, no mask (it lies before both of r's);
  s >  r  the second local chunk's queries only, the whole block, no mask.
So every step but the first costs half a block, on every rank. Backward runs the ring again: the
K/V blocks travel with their gradient accumulators, which return to their owner after cp hops.

Ulysses (ulysses_attention): an all-to-all turns sequence-sharded q/k/v into head-sharded,
full-length q/k/v, attention runs locally, and a second all-to-all turns the result back. It
needs cp to divide the number of kv heads.

Both keep grouped-query attention's kv heads as they are: a block carries num_kv_heads, not
num_heads. The math runs in fp32 for fp32, bf16 and fp16 inputs (in fp64 for fp64 ones).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaframe.parallel.attention_blocks import BlockKernel, block_kernel

__all__ = ["AttentionDropout", "ContextGroup", "ring_attention", "ulysses_attention", "zigzag_positions", "zigzag_shard",
           "zigzag_unshard"]

_KV_TAG, _GRAD_TAG = 0, 1  # the backward ring has two transfers in flight between the same ranks


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
             device: torch.device) -> torch.Tensor:
        """The keep mask (True: kept) of one block tile."""
        generator = torch.Generator(device=device)
        generator.manual_seed((self.seed * 1_000_003 + (cp_rank * 65_537 + step) * 65_537 + tile_start) % (1 << 63))
        return torch.rand(shape, generator=generator, device=device) >= self.p


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


# ---- one block -----------------------------------------------------------------------------------
# Scores of at most this many elements exist at once: query rows are taken in tiles, so a rank's
# 16k-token shard does not materialise a 16k x 16k score matrix per head.
_SCORE_ELEMENTS = 1 << 26


def _row_tiles(rows: slice, q: torch.Tensor, cols: int) -> list[slice]:
    """`rows` cut into tiles whose scores (batch x heads x tile x cols) stay under _SCORE_ELEMENTS."""
    per_row = q.shape[0] * q.shape[1] * q.shape[2] * max(cols, 1)
    tile = max(1, _SCORE_ELEMENTS // per_row)
    return [slice(start, min(start + tile, rows.stop)) for start in range(rows.start, rows.stop, tile)]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal_from: Optional[int]) -> torch.Tensor:
    """q (B, Hkv, G, Tq, D) against k (B, Hkv, Tk, D): (B, Hkv, G, Tq, Tk) in fp32. causal_from: the
    position of q's first row among k's columns when the block is causal (None: no mask)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if causal_from is not None:
        tq, tk = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1 + causal_from), float("-inf"))
    return s


def _block_rows_cols(step: int, cp: ContextGroup, c: int) -> tuple[slice, slice, bool]:
    """Which local query rows and block key columns step `step` needs, and whether causally."""
    source = (cp.rank - step) % cp.size
    if source == cp.rank:
        return slice(0, 2 * c), slice(0, 2 * c), True
    if source < cp.rank:
        return slice(0, 2 * c), slice(0, c), False
    return slice(c, 2 * c), slice(0, 2 * c), False


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _exchange(tensor: torch.Tensor, cp: ContextGroup, tag: int):
    """Send `tensor` to the next cp rank and receive the previous one's into a new buffer; returns
    (requests, buffer): wait on the requests before reading the buffer."""
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, cp.next_rank, cp.group, tag),
           dist.P2POp(dist.irecv, received, cp.prev_rank, cp.group, tag)]
    return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextGroup, scale: float, dropout: Optional[AttentionDropout]):
        # the fused kernels here take no dropout mask of ours: blocks with dropout are einsums
        kernel = block_kernel(q) if dropout is None else None
        ring = _FusedRing(kernel) if kernel is not None else _EinsumRing(dropout)
        out, lse = ring.forward(q, k, v, cp, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale, ctx.ring = cp, scale, ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(grad_out, q, k, v, out, lse, ctx.cp, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _EinsumRing:
    """Blocks as einsums over score tiles, in fp32 (fp64 for fp64): where no fused kernel runs, and
    under attention dropout (whose masks it draws per tile and redraws in the backward)."""

    def __init__(self, dropout: Optional[AttentionDropout] = None):
        self.dropout = dropout

    def _dropped(self, probs: torch.Tensor, cp: ContextGroup, step: int, rows: slice) -> torch.Tensor:
        """probs with this tile's dropout applied (kept entries scaled by 1/(1-p))."""
        if self.dropout is None:
            return probs
        keep = self.dropout.keep(cp.rank, step, rows.start, tuple(probs.shape), probs.device)
        return probs * keep / (1.0 - self.dropout.p)

    def forward(self, q, k, v, cp: ContextGroup, scale: float):
        B, H, T2, D = q.shape
        Hkv = k.shape[1]
        c = T2 // 2
        dtype = _math_dtype(q)
        qg = q.to(dtype).view(B, Hkv, H // Hkv, T2, D)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        kv = torch.stack([k, v])  # one message per hop, in the input dtype (bf16 sends half of fp32)
        for step in range(cp.size):
            pending = _exchange(kv, cp, _KV_TAG) if step + 1 < cp.size else None
            block_rows, cols, causal = _block_rows_cols(step, cp, c)
            kb, vb = kv[0][..., cols, :].to(dtype), kv[1][..., cols, :].to(dtype)
            for rows in _row_tiles(block_rows, qg, kb.shape[-2]):
                s = _scores(qg[..., rows, :], kb, scale, rows.start if causal else None)
                block_lse = torch.logsumexp(s, dim=-1)  # of the undropped scores: dropout rescales no row
                probs = self._dropped(torch.exp(s - block_lse[..., None]), cp, step, rows)
                block_out = torch.einsum("bhgqk,bhkd->bhgqd", probs, vb)
                _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        return out.view(B, H, T2, D), lse

    def backward(self, grad_out, q, k, v, out, lse, cp: ContextGroup, scale: float):
        B, H, T2, D = q.shape
        Hkv = k.shape[1]
        c = T2 // 2
        dtype = _math_dtype(q)
        qg = q.to(dtype).view(B, Hkv, H // Hkv, T2, D)
        dout = grad_out.to(dtype).reshape(B, Hkv, H // Hkv, T2, D)
        delta = (dout * out.view(qg.shape)).sum(-1)  # rowsum(dO * O), the softmax backward's correction
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        # the gradient of the block this rank holds, travelling with it (in fp32: it accumulates)
        dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
        for step in range(cp.size):
            pending = _exchange(kv, cp, _KV_TAG) if step + 1 < cp.size else None
            block_rows, cols, causal = _block_rows_cols(step, cp, c)
            kb, vb = kv[0][..., cols, :].to(dtype), kv[1][..., cols, :].to(dtype)
            for rows in _row_tiles(block_rows, qg, kb.shape[-2]):
                p = torch.exp(_scores(qg[..., rows, :], kb, scale, rows.start if causal else None)
                              - lse[..., rows, None])
                # with dropout O = (P*M/(1-p)) V: dV takes the dropped P, dP the dropped dO V^T, and
                # delta = rowsum(dO * O) is still the softmax backward's correction
                dp = self._dropped(torch.einsum("bhgqd,bhkd->bhgqk", dout[..., rows, :], vb), cp, step, rows)
                ds = p * (dp - delta[..., rows, None])
                dq[..., rows, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kb) * scale
                dkv[0][..., cols, :] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[..., rows, :]) * scale
                dkv[1][..., cols, :] += torch.einsum("bhgqk,bhgqd->bhkd", self._dropped(p, cp, step, rows),
                                                     dout[..., rows, :])
            dkv = _pass_home(dkv, cp)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        return dq.view(B, H, T2, D), dkv[0], dkv[1]


class _FusedRing:
    """Blocks through a fused kernel (parallel/attention_blocks.py) in the input dtype; the merge and
    the gradient accumulators in fp32 (fp64 for fp64). The backward gives each block the final
    output and log-sum-exp, so the kernel recomputes exactly that block's share of the softmax."""

    def __init__(self, kernel: BlockKernel):
        self.kernel = kernel
        self.saved: list = []  # per step, what the kernel's backward needs of its forward (small)

    def forward(self, q, k, v, cp: ContextGroup, scale: float):
        B, H, T2, D = q.shape
        c = T2 // 2
        dtype = _math_dtype(q)
        # like q: q is a (B, T, H, D) projection seen as (B, H, T, D), and so is out then, which lets
        # the output projection take it without a copy (one activation fewer saved per layer)
        out = torch.zeros_like(q, dtype=dtype)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp.size):
            pending = _exchange(kv, cp, _KV_TAG) if step + 1 < cp.size else None
            rows, cols, causal = _block_rows_cols(step, cp, c)
            kb, vb = (_heads_for(t[..., cols, :], H) for t in kv)
            block_out, block_lse, saved = self.kernel.forward(q[..., rows, :].contiguous(), kb, vb, causal, scale)
            self.saved.append(saved)
            _merge(out[..., rows, :], lse[..., rows], block_out.to(dtype), block_lse.to(dtype))
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, cp: ContextGroup, scale: float):
        B, H, T2, D = q.shape
        Hkv = k.shape[1]
        c = T2 // 2
        dtype = _math_dtype(q)
        out_q = out.to(q.dtype)  # the kernel's backward reads the output in the inputs' dtype
        dout = grad_out.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
        for step in range(cp.size):
            pending = _exchange(kv, cp, _KV_TAG) if step + 1 < cp.size else None
            rows, cols, causal = _block_rows_cols(step, cp, c)
            kb, vb = (_heads_for(t[..., cols, :], H) for t in kv)
            dq_b, dk_b, dv_b = self.kernel.backward(dout[..., rows, :].contiguous(), q[..., rows, :].contiguous(),
                                                    kb, vb, out_q[..., rows, :].contiguous(),
                                                    lse[..., rows].contiguous(), self.saved[step], causal, scale)
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += _sum_groups(dk_b, Hkv)
            dkv[1][..., cols, :] += _sum_groups(dv_b, Hkv)
            dkv = _pass_home(dkv, cp)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        return dq, dkv[0], dkv[1]


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's softmax result into the running one, in place, by their log-sum-exps."""
    merged = torch.logaddexp(lse, block_lse)
    out.copy_(out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None])
    lse.copy_(merged)


def _heads_for(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """A kv block (B, Hkv, t, D) with each kv head repeated for the query heads it serves."""
    group = heads // kv.shape[1]
    return (kv.repeat_interleave(group, dim=1) if group > 1 else kv).contiguous()


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, t, D) gradients of repeated kv heads -> (B, Hkv, t, D), summed over each group."""
    B, H, t, D = grad.shape
    return grad.view(B, kv_heads, H // kv_heads, t, D).sum(2) if H != kv_heads else grad


def _pass_home(dkv: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    """Send the travelling K/V gradients on to the next rank; after cp hops they are home."""
    if cp.size == 1:
        return dkv
    requests, received = _exchange(dkv, cp, _GRAD_TAG)
    _wait(requests)
    return received


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextGroup,
                   scale: Optional[float] = None, dropout: Optional[AttentionDropout] = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard: q (B, H, 2c, D), k and v (B, Hkv, 2c, D) with
    Hkv dividing H (grouped-query attention); returns (B, H, 2c, D). dropout: on the attention
    probabilities (training only; None or p=0: none)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if q.shape[2] % 2:
        raise ValueError(f"a zig-zag shard holds two equal chunks; got {q.shape[2]} tokens")
    if dropout is not None and dropout.p == 0:
        dropout = None
    return _RingAttention.apply(q, k, v, cp, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), dropout)


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
                      scale: Optional[float] = None, dropout: Optional[AttentionDropout] = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard by all-to-all over heads: q (B, H, 2c, D), k
    and v (B, Hkv, 2c, D); cp must divide Hkv. Returns (B, H, 2c, D). dropout: SDPA's own, on this
    rank's heads, from the generator the caller has made current (its seed is not used)."""
    if k.shape[1] % cp.size:
        raise ValueError(f"parallel.cp={cp.size} must divide the {k.shape[1]} kv heads for parallel.cp_impl=ulysses; "
                         f"use parallel.cp_impl=ring")
    qh, kh, vh = (_AllToAll.apply(t, cp, True) for t in (q, k, v))  # full length, in zig-zag order
    order, natural = _zigzag_order(qh.shape[2], cp.size, q.device)
    y = F.scaled_dot_product_attention(qh[:, :, natural], kh[:, :, natural], vh[:, :, natural], is_causal=True,
                                       scale=scale, enable_gqa=qh.shape[1] != kh.shape[1],
                                       dropout_p=0.0 if dropout is None else dropout.p)
    return _AllToAll.apply(y[:, :, order], cp, False)
