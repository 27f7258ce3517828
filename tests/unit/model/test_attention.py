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


def test_a_masked_sdpa_call_never_asks_for_gqa_which_no_fused_cuda_kernel_takes_with_a_mask(monkeypatch):
    """On CUDA, FlashAttention takes no mask and memory-efficient attention no grouped kv heads, so
    SDPA with both ran the math kernel: (B, H, T, T) fp32 scores a layer, out of memory at 16k
    tokens. With a document or window mask the cores now repeat the kv heads; unmasked calls keep
    enable_gqa (FlashAttention serves them without the copy)."""
    doc = torch.nn.functional.scaled_dot_product_attention.__doc__
    assert "It currently works only for Flash_attention" in doc, "torch's GQA kernels changed: see kv_heads_for_mask"
    import megaframe.model.attention as attention

    calls, sdpa = [], attention.F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], "attn_mask" in kwargs, kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    q, k, v = _qkv(heads=4, kv_heads=2)
    core = SDPACore(0.0, None, gqa=True).eval()
    documents = torch.tensor([[0] * 5 + [1] * 7] * 2)
    masked = core(q, k, v, Mask(documents=documents))
    core(q, k, v, CAUSAL)
    assert calls == [(4, 4, True, False), (4, 2, False, True)]
    repeated = [t.repeat_interleave(2, 1) for t in (k, v)]
    allowed = torch.ones(12, 12, dtype=torch.bool).tril() & (documents.unsqueeze(2) == documents.unsqueeze(1))
    scores = (q @ repeated[0].transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed.unsqueeze(1), float("-inf"))
    torch.testing.assert_close(masked, scores.softmax(-1) @ repeated[1])
