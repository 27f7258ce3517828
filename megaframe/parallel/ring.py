"""Ring attention: causal attention over the zig-zag shards of the cp ranks (parallel/context.py).

Each rank keeps its queries; the K/V blocks travel around the cp group, one hop per step, the next
transfer running while the current block is computed. Each block's partial result is merged into
the running one with its log-sum-exp, so the result is exactly softmax attention over the whole
sequence. Which part of a block is needed follows from the chunk positions (rank r receiving the
block of rank s):
  s == r  all local queries, all local keys, causal (the local positions increase);
  s <  r  all local queries, the block's first chunk only, no mask (it lies before both of r's);
  s >  r  the second local chunk's queries only, the whole block, no mask.
So every step but the first costs half a block, on every rank. Backward runs the ring again: the
K/V blocks travel with their gradient accumulators, which return to their owner after cp hops.

Document and window masks (RingMask) cut each block into its (query chunk, key chunk) pieces. A
piece the causal or window mask leaves empty is skipped; that follows from the chunks' positions
alone, which are static (no host read). Whether a piece holds a key of a query's document depends
on the tokens, and deciding it would read the device from the host per micro-batch: the document
mask is applied numerically to every piece computed (its masked scores are -inf). The zig-zag
layout stays as it is: under documents every rank computes the same pieces as under plain causal
attention; a window removes the far pieces from each rank alike (docs/attention.md has the counts).

A block runs through a fused attention kernel where the device has one (parallel/attention_blocks.py:
the block's output and log-sum-exp in the input dtype, the merge in fp32), otherwise, and under
attention dropout, as einsums over query tiles in fp32 (fp64 for fp64 inputs). K/V travel in the
input dtype and with num_kv_heads heads. A masked ring computes its pieces as einsums (the fused
kernels here take no mask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist

from megaframe.parallel.attention_blocks import BlockKernel, block_kernel
from megaframe.parallel.context import AttentionDropout, ContextGroup, attention_allowed

__all__ = ["RingMask", "ring_attention"]

_KV_TAG, _GRAD_TAG = 0, 1  # the backward ring has two transfers in flight between the same ranks


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


class Piece(NamedTuple):
    """What one ring step computes of a block: local query rows, block key columns, and the global
    positions of their first row and column (a piece lies inside one chunk on either side). causal:
    the plain ring's block mask (its queries see the block's keys up to their own local index)."""

    rows: slice
    cols: slice
    q_start: int = 0
    k_start: int = 0
    causal: bool = False


@dataclass(frozen=True, eq=False)
class RingMask:
    """A mask beyond plain causal attention: documents, the (B, T) document ids of the whole
    sequence (every cp rank holds them), and window, the keys each query sees (itself included)."""

    documents: Optional[torch.Tensor] = None
    window: Optional[int] = None

    def pieces(self, step: int, cp: ContextGroup, c: int) -> list[Piece]:
        """The (query chunk, key chunk) pieces of step `step` that the causal and window masks leave
        non-empty, from the chunks' positions only. Step 0's diagonal pieces come first, so every
        query row has seen a key (itself) before any piece that may mask it whole."""
        source = (cp.rank - step) % cp.size
        q_chunks = (cp.rank, 2 * cp.size - 1 - cp.rank)  # global chunk of local chunk 0 and 1
        k_chunks = (source, 2 * cp.size - 1 - source)
        pairs = [(a, b) for a in (0, 1) for b in (0, 1)]
        pairs.sort(key=lambda ab: q_chunks[ab[0]] != k_chunks[ab[1]])  # diagonal first (a stable sort)
        return [Piece(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), q_chunks[a] * c, k_chunks[b] * c)
                for a, b in pairs if not self._empty(q_chunks[a], k_chunks[b], c)]

    def _empty(self, q_chunk: int, k_chunk: int, c: int) -> bool:
        """Whether no query of chunk q_chunk sees a key of chunk k_chunk: all keys later, or the
        nearest (the last key, from the first query) farther back than the window."""
        nearest = (q_chunk - k_chunk) * c - (c - 1)
        return k_chunk > q_chunk or (self.window is not None and nearest >= self.window)

    def allowed(self, piece: Piece, rows: slice, keys: int, device: torch.device) -> torch.Tensor:
        """The mask of one tile (rows of a piece, its `keys` columns), (1 or B, 1, 1, tq, tk): the
        shape of the (B, Hkv, G, tq, tk) scores."""
        q_start = piece.q_start + rows.start - piece.rows.start
        q_pos = torch.arange(q_start, q_start + rows.stop - rows.start, device=device)
        k_pos = torch.arange(piece.k_start, piece.k_start + keys, device=device)
        ids = self.documents
        q_ids = None if ids is None else ids[:, q_start:q_start + len(q_pos)]
        k_ids = None if ids is None else ids[:, piece.k_start:piece.k_start + keys]
        return attention_allowed(q_pos, k_pos, self.window, q_ids, k_ids)[:, None, None]


def _plain_pieces(step: int, cp: ContextGroup, c: int) -> list[Piece]:
    """The plain causal ring's one piece per step (what _block_rows_cols says)."""
    rows, cols, causal = _block_rows_cols(step, cp, c)
    return [Piece(rows, cols, causal=causal)]


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


def _ring_steps(k: torch.Tensor, v: torch.Tensor, cp: ContextGroup, c: int) -> Iterator[tuple]:
    """The ring's schedule: for each step, (step, query rows, block columns, causal, the K/V block
    stacked as one tensor), with the next hop's transfer in flight while the caller computes. K/V
    travel as one message in the input dtype (bf16 sends half of fp32)."""
    kv = torch.stack([k, v])
    for step in range(cp.size):
        pending = _exchange(kv, cp, _KV_TAG) if step + 1 < cp.size else None
        rows, cols, causal = _block_rows_cols(step, cp, c)
        yield step, rows, cols, causal, kv
        if pending is not None:
            _wait(pending[0])
            kv = pending[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextGroup, scale: float, dropout: Optional[AttentionDropout],
                mask: Optional[RingMask]):
        # the fused kernels here take no dropout or attention mask of ours: such blocks are einsums
        kernel = block_kernel(q) if dropout is None and mask is None else None
        ring = _FusedRing(kernel) if kernel is not None else _EinsumRing(dropout, mask)
        out, lse = ring.forward(q, k, v, cp, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale, ctx.ring = cp, scale, ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(grad_out, q, k, v, out, lse, ctx.cp, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class _EinsumRing:
    """Blocks as einsums over score tiles, in fp32 (fp64 for fp64): where no fused kernel runs, under
    attention dropout (whose masks it draws per tile and redraws in the backward), and under a
    document or window mask (each block's non-empty pieces, RingMask)."""

    def __init__(self, dropout: Optional[AttentionDropout] = None, mask: Optional[RingMask] = None):
        self.dropout, self.mask = dropout, mask

    def _pieces(self, step: int, cp: ContextGroup, c: int) -> list[Piece]:
        return _plain_pieces(step, cp, c) if self.mask is None else self.mask.pieces(step, cp, c)

    def _tile_scores(self, q: torch.Tensor, kb: torch.Tensor, scale: float, piece: Piece, rows: slice) -> torch.Tensor:
        if self.mask is None:
            return _scores(q, kb, scale, rows.start if piece.causal else None)
        s = _scores(q, kb, scale, None)
        return s.masked_fill(~self.mask.allowed(piece, rows, kb.shape[-2], s.device), float("-inf"))

    def _keep_scaled(self, shape: torch.Size, device: torch.device, cp: ContextGroup, step: int,
                     rows: slice, piece: Piece) -> Optional[torch.Tensor]:
        """This tile's keep mask over 1 - p (None without dropout): what dropout multiplies by."""
        if self.dropout is None:
            return None
        # a masked ring's pieces of one step share query rows: their key columns tell them apart
        keep = self.dropout.keep(cp.rank, step, rows.start, tuple(shape), device,
                                 col_start=0 if self.mask is None else piece.cols.start)
        return keep / (1.0 - self.dropout.p)

    def forward(self, q, k, v, cp: ContextGroup, scale: float):
        B, H, T2, D = q.shape
        Hkv = k.shape[1]
        c = T2 // 2
        dtype = _math_dtype(q)
        qg = q.to(dtype).view(B, Hkv, H // Hkv, T2, D)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        for step, _, _, _, kv in _ring_steps(k, v, cp, c):
            for piece in self._pieces(step, cp, c):
                kb, vb = kv[0][..., piece.cols, :].to(dtype), kv[1][..., piece.cols, :].to(dtype)
                for rows in _row_tiles(piece.rows, qg, kb.shape[-2]):
                    s = self._tile_scores(qg[..., rows, :], kb, scale, piece, rows)
                    block_lse = torch.logsumexp(s, dim=-1)  # of the undropped scores: dropout rescales no row
                    if self.mask is not None:  # a row the mask empties here: zero weights, not exp(nan)
                        probs = torch.exp(s - block_lse.clamp_min(torch.finfo(dtype).min)[..., None])
                    else:
                        probs = torch.exp(s - block_lse[..., None])
                    keep = self._keep_scaled(probs.shape, probs.device, cp, step, rows, piece)
                    if keep is not None:
                        probs = probs * keep
                    block_out = torch.einsum("bhgqk,bhkd->bhgqd", probs, vb)
                    _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
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
        # the gradient of the block this rank holds, travelling with it (in fp32: it accumulates)
        dkv = torch.zeros((2, *k.shape), dtype=dtype, device=k.device)
        for step, _, _, _, kv in _ring_steps(k, v, cp, c):
            for piece in self._pieces(step, cp, c):
                cols = piece.cols
                kb, vb = kv[0][..., cols, :].to(dtype), kv[1][..., cols, :].to(dtype)
                for rows in _row_tiles(piece.rows, qg, kb.shape[-2]):
                    p = torch.exp(self._tile_scores(qg[..., rows, :], kb, scale, piece, rows) - lse[..., rows, None])
                    # with dropout O = (P*M/(1-p)) V: dV takes the dropped P, dP the dropped dO V^T, and
                    # delta = rowsum(dO * O) is still the softmax backward's correction
                    dp = torch.einsum("bhgqd,bhkd->bhgqk", dout[..., rows, :], vb)
                    keep = self._keep_scaled(p.shape, p.device, cp, step, rows, piece)
                    if keep is not None:
                        dp = dp * keep
                    ds = p * (dp - delta[..., rows, None])
                    dq[..., rows, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kb) * scale
                    dkv[0][..., cols, :] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qg[..., rows, :]) * scale
                    dkv[1][..., cols, :] += torch.einsum("bhgqk,bhgqd->bhkd", p if keep is None else p * keep,
                                                         dout[..., rows, :])
            dkv = _pass_home(dkv, cp)
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
        for _, rows, cols, causal, kv in _ring_steps(k, v, cp, c):
            kb, vb = (_heads_for(t[..., cols, :], H) for t in kv)
            block_out, block_lse, saved = self.kernel.forward(q[..., rows, :].contiguous(), kb, vb, causal, scale)
            self.saved.append(saved)
            _merge(out[..., rows, :], lse[..., rows], block_out.to(dtype), block_lse.to(dtype))
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, cp: ContextGroup, scale: float):
        B, H, T2, D = q.shape
        Hkv = k.shape[1]
        c = T2 // 2
        dtype = _math_dtype(q)
        out_q = out.to(q.dtype)  # the kernel's backward reads the output in the inputs' dtype
        dout = grad_out.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=dtype, device=k.device)
        for step, rows, cols, causal, kv in _ring_steps(k, v, cp, c):
            kb, vb = (_heads_for(t[..., cols, :], H) for t in kv)
            dq_b, dk_b, dv_b = self.kernel.backward(dout[..., rows, :].contiguous(), q[..., rows, :].contiguous(),
                                                    kb, vb, out_q[..., rows, :].contiguous(),
                                                    lse[..., rows].contiguous(), self.saved[step], causal, scale)
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += _sum_groups(dk_b, Hkv)
            dkv[1][..., cols, :] += _sum_groups(dv_b, Hkv)
            dkv = _pass_home(dkv, cp)
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
                   scale: Optional[float] = None, dropout: Optional[AttentionDropout] = None,
                   documents: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard: q (B, H, 2c, D), k and v (B, Hkv, 2c, D) with
    Hkv dividing H (grouped-query attention); returns (B, H, 2c, D). dropout: on the attention
    probabilities (training only; None or p=0: none). documents: the (B, T) document ids of the
    whole sequence (not the shard), window: the keys each query sees; either restricts the mask."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if q.shape[2] % 2:
        raise ValueError(f"a zig-zag shard holds two equal chunks; got {q.shape[2]} tokens")
    if dropout is not None and dropout.p == 0:
        dropout = None
    mask = RingMask(documents, window) if documents is not None or window is not None else None
    return _RingAttention.apply(q, k, v, cp, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), dropout,
                                mask)
