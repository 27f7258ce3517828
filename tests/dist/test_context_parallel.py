"""Ring and Ulysses attention (parallel/context.py) on real gloo ranks against full causal SDPA on
one process: outputs and the gradients of q, k and v, shard by shard; the ring with its blocks
through the fused CPU kernel and through the einsum fallback. The reference runs in fp64 and fp32;
the sharded fp32 result must lie within a small multiple of the fp32 reference's own rounding
(tests/support/numerics.py), which holds on any host."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaframe.model.attention import CAUSAL, build_attention_core
from megaframe.parallel.ring import ring_attention
from megaframe.parallel.context import (ContextGroup, ulysses_attention, zigzag_positions,
                                        zigzag_shard, zigzag_unshard)
from tests.support.numerics import assert_fp32_close
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


def _inputs(heads: int, kv_heads: int, seq: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, 8, generator=g, dtype=dtype)
    k = torch.randn(2, kv_heads, seq, 8, generator=g, dtype=dtype)
    v = torch.randn(2, kv_heads, seq, 8, generator=g, dtype=dtype)
    grad = torch.randn(2, heads, seq, 8, generator=g, dtype=dtype)
    return q, k, v, grad


def _reference(heads: int, kv_heads: int, seq: int, dtype=torch.float32):
    """Full-sequence causal SDPA (kv heads repeated for GQA) and its gradients: the independent
    answer, from the fp32 inputs computed in `dtype`."""
    q, k, v, grad = (t.to(dtype) for t in _inputs(heads, kv_heads, seq))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    repeat = heads // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                         is_causal=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(rank: int, world: int, impl: str, heads: int, kv_heads: int, seq: int):
    cp = ContextGroup(group=None, ranks=tuple(range(world)), rank=rank)
    q, k, v, grad = (zigzag_shard(t, world, rank, dim=2) for t in _inputs(heads, kv_heads, seq))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    core = build_attention_core(0.0, None, False, cp, impl)  # the model's path: its core (model/attention.py)
    out = core(q, k, v, CAUSAL)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _einsum_blocks(monkeypatch) -> None:
    """Ring blocks through the einsum path (no fused kernel), as on a device without one; the
    ranks are forked, so they see it too."""
    import megaframe.parallel.ring as ring

    monkeypatch.setattr(ring, "block_kernel", lambda q: None)


@pytest.mark.parametrize("impl, cp, heads, kv_heads", [
    ("ring", 2, 4, 4), ("ring", 4, 4, 4), ("ring", 2, 4, 2), ("ring", 4, 6, 2),
    ("ring-einsum", 2, 4, 4), ("ring-einsum", 4, 6, 2),
    ("ulysses", 2, 4, 4), ("ulysses", 2, 4, 2), ("ulysses", 4, 8, 4),
])
def test_context_parallel_attention_equals_full_attention(tmp_path, monkeypatch, impl, cp, heads, kv_heads):
    """ring: blocks through the CPU's fused flash kernel; ring-einsum: the einsum fallback."""
    if impl == "ring-einsum":
        _einsum_blocks(monkeypatch)
        impl = "ring"
    seq = 8 * cp
    results = run_ranks(_sharded, cp, tmp_path, timeout=300, impl=impl, heads=heads, kv_heads=kv_heads, seq=seq)
    _assert_gathered_equal_reference(results, heads, kv_heads, seq, f"{impl} cp={cp} h={heads}/{kv_heads}")


NAMES = ("output", "grad q", "grad k", "grad v")


def _assert_gathered_equal_reference(results, heads: int, kv_heads: int, seq: int, what: str,
                                     indices=(0, 1, 2, 3), pick=lambda results, index: [r[index] for r in results]):
    ref64, ref32 = _reference(heads, kv_heads, seq, torch.float64), _reference(heads, kv_heads, seq)
    for index in indices:
        gathered = zigzag_unshard(pick(results, index), dim=2)
        assert_fp32_close(gathered, ref64[index], ref32[index], f"{what} {NAMES[index]}")


def _rank_of_a_second_group(rank: int, world: int):
    """cp groups that are not the whole world: ranks {0, 2} and {1, 3} (cp=2 inside dp=2)."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    members = (0, 2) if rank % 2 == 0 else (1, 3)
    cp = ContextGroup(group=groups[rank % 2], ranks=members, rank=members.index(rank))
    q, k, v, grad = (zigzag_shard(t, 2, cp.rank, dim=2) for t in _inputs(4, 2, 16))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cp)
    out.backward(grad)
    return cp.rank, out.detach(), k.grad


def test_ring_runs_inside_a_cp_group_of_a_larger_world(tmp_path):
    results = run_ranks(_rank_of_a_second_group, 4, tmp_path, timeout=300)
    for members in ((0, 2), (1, 3)):
        shards = sorted((results[r] for r in members), key=lambda result: result[0])
        # each shard is (cp rank, output, grad k)
        _assert_gathered_equal_reference(shards, 4, 2, 16, f"ring in group {members}", indices=(0, 2),
                                         pick=lambda shards, index: [s[1 if index == 0 else 2] for s in shards])


def _bytes_sent(rank: int, world: int, impl: str, heads: int, kv_heads: int, seq: int):
    """Bytes this rank hands to point-to-point sends and all-to-alls in one forward and backward."""
    import megaframe.parallel.context as context
    import megaframe.parallel.ring as ring

    sent = {"forward": 0, "backward": 0}
    phase = ["forward"]
    real_batch, real_all_to_all = dist.batch_isend_irecv, dist.all_to_all_single

    def batch(ops):
        sent[phase[0]] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    def all_to_all(output, input, group=None):
        # the slice a rank keeps for itself never leaves it
        sent[phase[0]] += input.numel() * input.element_size() * (world - 1) // world
        return real_all_to_all(output, input, group=group)

    ring.dist.batch_isend_irecv, context.dist.all_to_all_single = batch, all_to_all
    try:
        q, k, v, grad = (zigzag_shard(t, world, rank, dim=2) for t in _inputs(heads, kv_heads, seq))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = (ring_attention if impl == "ring" else ulysses_attention)(q, k, v, ContextGroup(None, tuple(range(world)), rank))
        phase[0] = "backward"
        out.backward(grad)
    finally:
        ring.dist.batch_isend_irecv, context.dist.all_to_all_single = real_batch, real_all_to_all
    return sent


@pytest.mark.parametrize("impl, cp", [("ring", 2), ("ring", 4), ("ulysses", 2), ("ulysses", 4)])
def test_communication_per_layer_matches_the_formula(tmp_path, impl, cp):
    """Per rank and attention layer, with b = batch * kv_heads * (seq/cp) * head_dim * 4 bytes (one
    of k or v, fp32) and q_b the same with query heads:
      ring     forward (cp-1) * 2b (K and V, cp-1 hops); backward (cp-1) * 2b again plus cp * 2b
               (the K/V gradients travel cp hops, back to their owner)
      ulysses  forward (q_b + 2b + q_b) * (cp-1)/cp (q, k, v in, the output back); backward the same"""
    heads, kv_heads, seq, batch, head_dim = 8, 4, 16 * cp, 2, 8
    results = run_ranks(_bytes_sent, cp, tmp_path, timeout=300, impl=impl, heads=heads, kv_heads=kv_heads, seq=seq)
    b = batch * kv_heads * (seq // cp) * head_dim * 4
    q_b = b * heads // kv_heads
    if impl == "ring":
        expected = {"forward": (cp - 1) * 2 * b, "backward": (cp - 1) * 2 * b + cp * 2 * b}
    else:
        expected = {"forward": (2 * q_b + 2 * b) * (cp - 1) // cp, "backward": (2 * q_b + 2 * b) * (cp - 1) // cp}
    assert all(r == expected for r in results), (results, expected)


def test_query_tiles_give_the_same_result(tmp_path, monkeypatch):
    """A tiny score budget cuts every einsum block into tiles of 1-2 query rows: still full attention."""
    import megaframe.parallel.ring as ring

    _einsum_blocks(monkeypatch)
    monkeypatch.setattr(ring, "_SCORE_ELEMENTS", 2 * 4 * 8 * 2)  # ranks are forked: they see it too
    results = run_ranks(_sharded, 2, tmp_path, timeout=300, impl="ring", heads=4, kv_heads=2, seq=16)
    _assert_gathered_equal_reference(results, 4, 2, 16, "ring in tiles")


P_DROP, SEED = 0.3, 1234


def _ring_with_dropout(rank: int, world: int, heads: int, kv_heads: int, seq: int):
    from megaframe.parallel.context import AttentionDropout

    cp = ContextGroup(group=None, ranks=tuple(range(world)), rank=rank)
    q, k, v, grad = (zigzag_shard(t, world, rank, dim=2) for t in _inputs(heads, kv_heads, seq))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cp, dropout=AttentionDropout(P_DROP, SEED))
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _full_keep_mask(heads: int, kv_heads: int, seq: int, cp: int) -> torch.Tensor:
    """The (B, H, T, T) keep mask the ring's blocks drew, placed by the tokens' global positions:
    the ring's schedule replayed (which block and tile each rank computes at each step)."""
    from megaframe.parallel.context import AttentionDropout
    from megaframe.parallel.ring import _block_rows_cols, _row_tiles

    dropout, c, group = AttentionDropout(P_DROP, SEED), seq // (2 * cp), heads // kv_heads
    full = torch.zeros(2, heads, seq, seq, dtype=torch.bool)
    for rank in range(cp):
        ring = ContextGroup(None, tuple(range(cp)), rank)
        for step in range(cp):
            rows, cols, _ = _block_rows_cols(step, ring, c)
            source = (rank - step) % cp
            queries, keys = zigzag_positions(seq, cp, rank), zigzag_positions(seq, cp, source)[cols]
            qg_shape = torch.empty(2, kv_heads, group, 2 * c, 8)
            for tile in _row_tiles(rows, qg_shape, keys.numel()):
                shape = (2, kv_heads, group, tile.stop - tile.start, keys.numel())
                keep = dropout.keep(rank, step, tile.start, shape, torch.device("cpu")).reshape(2, heads, *shape[-2:])
                full[:, :, queries[tile].unsqueeze(-1), keys] = keep
    return full


def _dropped_attention(heads: int, kv_heads: int, seq: int, keep: torch.Tensor, dtype: torch.dtype):
    """Causal attention written out, its probabilities dropped by `keep`, and its gradients, in `dtype`."""
    q, k, v, grad = (t.to(dtype) for t in _inputs(heads, kv_heads, seq))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    repeat = heads // kv_heads
    scores = q @ k.repeat_interleave(repeat, 1).transpose(-1, -2) / 8 ** 0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = (probs * keep / (1 - P_DROP)) @ v.repeat_interleave(repeat, 1)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp, heads, kv_heads", [(2, 4, 2), (4, 4, 4)])
def test_ring_attention_dropout_is_attention_with_its_mask(tmp_path, cp, heads, kv_heads):
    """Output and q/k/v gradients equal full causal attention (fp64) whose probabilities are
    dropped by the mask the ring drew: so the backward redraws the forward's masks, and every
    block's mask lands where its scores are. The mask drops about p of the entries, and the cp
    ranks' masks are not copies of each other."""
    seq = 8 * cp
    results = run_ranks(_ring_with_dropout, cp, tmp_path, timeout=300, heads=heads, kv_heads=kv_heads, seq=seq)
    keep = _full_keep_mask(heads, kv_heads, seq, cp)
    ref64, ref32 = (_dropped_attention(heads, kv_heads, seq, keep, dtype) for dtype in (torch.float64, torch.float32))
    for index, name in enumerate(NAMES):
        gathered = zigzag_unshard([r[index] for r in results], dim=2)
        assert_fp32_close(gathered, ref64[index], ref32[index], f"ring dropout cp={cp} {name}")
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    kept = keep[:, :, causal].float().mean().item()
    assert abs(kept - (1 - P_DROP)) < 0.05, kept
    chunk = seq // (2 * cp)  # the diagonal blocks of ranks 0 and 1 (first chunks) hold different masks
    assert not torch.equal(keep[:, :, :chunk, :chunk], keep[:, :, chunk:2 * chunk, chunk:2 * chunk])


def _skip_the_last_block(ring) -> None:
    """Every rank leaves out the ring's last step (the collectives still pair up)."""
    real = ring._ring_steps

    def steps(k, v, cp, c):
        yield from (item for item in real(k, v, cp, c) if item[0] != cp.size - 1)
    ring._ring_steps = steps


def _causal_mask_one_off(ring) -> None:
    """A query tile's position among the block's keys off by one: the diagonal shifts."""
    real = ring._scores
    ring._scores = lambda q, k, scale, causal_from: real(q, k, scale, None if causal_from is None else causal_from + 1)


def _gqa_heads_in_the_wrong_order(ring) -> None:
    """kv heads tiled (h -> h mod Hkv) instead of each serving its group of query heads."""
    ring._heads_for = lambda kv, heads: kv.repeat(1, heads // kv.shape[1], 1, 1).contiguous()


def _a_gqa_head_gradient_missing(ring) -> None:
    """The last query head of each group left out of its kv head's gradient."""
    ring._sum_groups = lambda grad, kv_heads: grad.view(grad.shape[0], kv_heads, -1, *grad.shape[2:])[:, :, :-1].sum(2)


@pytest.mark.parametrize("mutation, einsum", [(_skip_the_last_block, False), (_causal_mask_one_off, True),
                                              (_gqa_heads_in_the_wrong_order, False),
                                              (_a_gqa_head_gradient_missing, False)],
                         ids=["skipped block", "tile offset", "gqa head order", "gqa head missing"])
def test_the_arithmetic_bound_still_catches_a_broken_ring(tmp_path, monkeypatch, mutation, einsum):
    """The fp64-derived allowance (tests/support/numerics.py) is about 1e-6 of O(1) values; each of these
    bugs moves some output or gradient by far more, and must fail the comparison."""
    import megaframe.parallel.ring as ring

    for name in ("_ring_steps", "_scores", "_heads_for", "_sum_groups"):
        monkeypatch.setattr(ring, name, getattr(ring, name))  # restored after the test
    if einsum:
        _einsum_blocks(monkeypatch)
        monkeypatch.setattr(ring, "_SCORE_ELEMENTS", 2 * 4 * 8 * 2)  # tiles of 1-2 query rows
    mutation(ring)  # the ranks are forked: they run the mutant
    results = run_ranks(_sharded, 2, tmp_path, timeout=300, impl="ring", heads=4, kv_heads=2, seq=16)
    with pytest.raises(AssertionError, match="from the fp64 reference"):
        _assert_gathered_equal_reference(results, 4, 2, 16, f"mutant {mutation.__name__}")
