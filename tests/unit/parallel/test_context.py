"""Zig-zag sharding (parallel/context.py): which tokens a cp rank holds, and the refusal of a
sequence that 2*cp does not divide."""
from __future__ import annotations

import pytest
import torch

from megaframe.parallel.context import ContextGroup, zigzag_positions, zigzag_shard, zigzag_unshard
from megaframe.parallel.ring import ring_attention


def test_each_rank_holds_an_early_and_a_late_chunk():
    # 16 tokens, cp=4: 8 chunks of 2; rank i holds chunks i and 7-i
    assert zigzag_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert zigzag_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    every = torch.cat([zigzag_positions(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))


def test_causal_work_is_balanced():
    """Query-key pairs under the causal mask, per rank: equal at cp=4 (the point of the zig-zag)."""
    work = [sum(int(p) + 1 for p in zigzag_positions(64, 4, r)) for r in range(4)]
    assert len(set(work)) == 1, work


def test_shard_and_unshard_are_inverse():
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [zigzag_shard(x, 3, r) for r in range(3)]
    assert torch.equal(zigzag_unshard(shards), x)
    assert torch.equal(shards[1][0, :, 0], x[0, zigzag_positions(24, 3, 1), 0])


def test_a_sequence_2cp_does_not_divide_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"model.seq_length=30 must be divisible by 2\*parallel.cp=8") as err:
        zigzag_positions(30, 4, 0)
    assert "\n" not in str(err.value)


def test_ring_of_one_is_plain_causal_attention():
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, ContextGroup(group=None, ranks=(0,), rank=0))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(lambda a, b, c: ring_attention(a, b, c, ContextGroup(None, (0,), 0)),
                                    (q, k, v))


def test_every_ring_tile_draws_its_own_dropout_mask():
    """Ring dropout's masks: the same (rank, step, tile) redraws the same mask (the backward relies
    on it), and distinct ones, also far into a long shard, draw distinct masks."""
    from megaframe.parallel.context import AttentionDropout

    dropout = AttentionDropout(0.5, seed=7)
    cpu = torch.device("cpu")
    assert torch.equal(dropout.keep(1, 2, 96, (4, 64), cpu), dropout.keep(1, 2, 96, (4, 64), cpu))
    places = [(rank, step, tile) for rank in range(4) for step in range(4) for tile in (0, 3, 65_537, 65_540, 1 << 20)]
    masks = {tuple(dropout.keep(*place, (256,), cpu).tolist()) for place in places}
    assert len(masks) == len(places)
    assert not torch.equal(dropout.keep(0, 0, 65_540, (256,), cpu), dropout.keep(0, 1, 3, (256,), cpu))
    assert not torch.equal(dropout.keep(0, 0, 0, (256,), cpu), AttentionDropout(0.5, seed=8).keep(0, 0, 0, (256,), cpu))
