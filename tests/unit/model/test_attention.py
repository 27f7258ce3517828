"""The attention cores (model/attention.py) against full causal attention written out by hand
(softmax of masked scores), and build_attention_core's choice. Ring and Ulysses across real cp
ranks: tests/dist/test_context_parallel.py, which runs them through these cores."""
from __future__ import annotations

import math

import pytest
import torch

from megaframe.model.attention import (CAUSAL, SDPA_HAS_GQA, Mask, RingCore, SDPACore, UlyssesCore,
                                       build_attention_core, decode_attention)
from megaframe.parallel.context import ContextGroup
from megaframe.parallel.random import TPDropoutRNG

ONE_CP_RANK = ContextGroup(group=None, ranks=(0,), rank=0)


def _qkv(heads: int = 4, kv_heads: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, seq, 8, generator=g), torch.randn(2, kv_heads, seq, 8, generator=g),
            torch.randn(2, kv_heads, seq, 8, generator=g))


def _causal_attention(q, k, v):
    """The definition, independent of any kernel: kv heads repeated, future keys masked out."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("core, heads, kv_heads", [
    (SDPACore(0.1, None, gqa=False), 4, 4),
    pytest.param(SDPACore(0.1, None, gqa=True), 4, 2,
                 marks=pytest.mark.skipif(not SDPA_HAS_GQA, reason="this torch's SDPA has no enable_gqa")),
    (RingCore(0.1, None, ONE_CP_RANK), 4, 4), (RingCore(0.1, None, ONE_CP_RANK), 4, 2),
], ids=["sdpa", "sdpa-gqa", "ring", "ring-gqa"])
def test_each_core_is_causal_attention(core, heads, kv_heads):
    """In eval (dropout off) a core is causal attention, kv heads shared by their query groups."""
    q, k, v = _qkv(heads, kv_heads)
    core.eval()
    torch.testing.assert_close(core(q, k, v, CAUSAL), _causal_attention(q, k, v))


def test_sdpa_dropout_draws_from_the_tp_stream_only():
    """In training the SDPA core's dropout draws from the rank's TP stream (parallel/random.py) and
    leaves torch's default stream where it was; the same stream state redraws the same masks."""
    q, k, v = _qkv()
    core = SDPACore(0.5, TPDropoutRNG(seed=3, tp_rank=1), gqa=False).train()
    state, before = core.rng.state_dict(), torch.random.get_rng_state()
    first = core(q, k, v, CAUSAL)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert not torch.allclose(first, _causal_attention(q, k, v))  # dropout acted
    core.rng.load_state_dict(state)
    assert torch.equal(core(q, k, v, CAUSAL), first)


def test_build_attention_core_chooses_by_layout():
    assert type(build_attention_core(0.0, None, False)) is SDPACore
    assert type(build_attention_core(0.0, None, False, ONE_CP_RANK, "ring")) is RingCore
    assert type(build_attention_core(0.0, None, False, ONE_CP_RANK, "ulysses")) is UlyssesCore
    with pytest.raises(ValueError, match="parallel.cp_impl='stripes' is not one of"):
        build_attention_core(0.0, None, False, ONE_CP_RANK, "stripes")


def test_a_cp_core_refuses_a_mask_it_cannot_apply():
    q, k, v = _qkv()
    core = RingCore(0.0, None, ONE_CP_RANK)
    assert core.supports(CAUSAL) and not core.supports(Mask(causal=False))
    with pytest.raises(ValueError, match="RingCore attends causally only"):
        core(q, k, v, Mask(causal=False))


def test_decode_attention_continues_the_causal_mask_after_the_cache():
    """Queries past..past+T-1 against the cache and themselves: the rows of full causal attention."""
    q, k, v = _qkv(seq=12)
    full = _causal_attention(q, k, v)
    for past, new in ((0, 12), (9, 3), (11, 1)):
        got = decode_attention(q[:, :, past:past + new], k[:, :, :past + new], v[:, :, :past + new], past, gqa=False)
        torch.testing.assert_close(got, full[:, :, past:past + new])
