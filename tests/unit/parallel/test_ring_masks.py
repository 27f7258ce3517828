"""The masked ring (parallel/ring.py's RingMask) in one process: at cp=1 the ring is its own block, cut
into the pieces of its two zig-zag chunks, so its mask, its skipped pieces and its backward can be
checked without ranks (tests/dist/test_context_parallel_masks.py checks cp=2 against full attention)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaframe.parallel.context import AttentionDropout, ContextGroup, attention_allowed
from megaframe.parallel.ring import RingMask, ring_attention

ONE = ContextGroup(group=None, ranks=(0,), rank=0)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 12, 4, generator=g, dtype=dtype)
    k, v = (torch.randn(1, 1, 12, 4, generator=g, dtype=dtype) for _ in range(2))
    ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2]])  # a document crosses the chunks (6 tokens)
    return q, k, v, ids


@pytest.mark.parametrize("window, documents", [(None, True), (3, False), (7, True)])
def test_the_masked_ring_is_attention_with_the_whole_mask(window, documents):
    q, k, v, ids = _inputs()
    ids = ids if documents else None
    pos = torch.arange(12)
    allowed = attention_allowed(pos, pos, window, ids, ids)[:, None]
    want = F.scaled_dot_product_attention(q, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1), attn_mask=allowed)
    torch.testing.assert_close(ring_attention(q, k, v, ONE, documents=ids, window=window), want)


def test_a_window_within_a_chunk_skips_the_far_piece():
    # chunks of 6 at cp=1: pieces (0, 0), (1, 1) and (1, 0), whose nearest query and key are 1 apart
    assert len(RingMask(window=2).pieces(0, ONE, 6)) == 3
    assert len(RingMask(window=1).pieces(0, ONE, 6)) == 2  # a query sees only itself: the diagonal pieces
    assert len(RingMask(documents=torch.zeros(1, 12)).pieces(0, ONE, 6)) == 3


def test_the_masked_ring_backward_with_dropout_is_its_forward_s_gradient():
    """Dropout's tile masks are redrawn per piece in the backward: gradcheck in fp64 (the masks fixed
    by their seeds) sees the backward of exactly the forward's masked, dropped pieces."""
    q, k, v, ids = _inputs()
    dropout = AttentionDropout(0.3, seed=11)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: ring_attention(q, k, v, ONE, dropout=dropout, documents=ids,
                                                                  window=7), inputs)
