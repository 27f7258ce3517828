"""Ring attention on CUDA (not yet run on a GPU). Its block kernel, FlashAttention-2 through aten
(parallel/attention_blocks.py): blocks merged by log-sum-exp equal full causal attention, forward
and backward, in bf16 and fp16 (the CPU twin: tests/unit/parallel/test_attention_blocks.py). And the
ring itself on one rank (cp=1 needs no process group): the fused path with grouped-query heads in
bf16 against SDPA, and the einsum path's dropout masks drawn by a CUDA generator, redrawn in the
backward, against attention with those masks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.attention_blocks_check import blocks_against_full_attention
from megaframe.parallel.attention_blocks import CUDA_FLASH, block_kernel
from megaframe.parallel.context import AttentionDropout, ContextGroup
from megaframe.parallel.ring import ring_attention

ONE_RANK = ContextGroup(group=None, ranks=(0,), rank=0)


@pytest.fixture
def flash_gpu():
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("FlashAttention-2 needs sm80 or newer; this GPU's ring blocks are einsums")


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
def test_blocks_through_the_cuda_kernel_merge_to_full_attention(flash_gpu, dtype, tolerance):
    assert block_kernel(torch.empty(1, 1, 2, 16, device="cuda", dtype=dtype)) is CUDA_FLASH
    worst = blocks_against_full_attention("cuda", dtype)
    assert max(worst.values()) < tolerance, worst


def _qkv(heads: int, kv_heads: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, heads, 64, 64), (2, kv_heads, 64, 64), (2, kv_heads, 64, 64), (2, heads, 64, 64)]
    return [torch.randn(s, device="cuda", dtype=dtype, generator=g) for s in shapes]


def test_the_fused_ring_with_grouped_query_heads_equals_sdpa(flash_gpu):
    q, k, v, grad = _qkv(8, 2, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ring_attention(*leaves, ONE_RANK).backward(grad)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(ref[0], ref[1], ref[2], is_causal=True, enable_gqa=True).backward(grad)
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.float(), want.grad.float(), rtol=0.05, atol=0.05)


def test_ring_dropout_on_cuda_redraws_its_masks_in_the_backward():
    q, k, v, grad = _qkv(4, 4, torch.float32)
    dropout = AttentionDropout(0.3, seed=99)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, ONE_RANK, dropout=dropout)
    out.backward(grad)
    # cp=1: one causal block, one tile, drawn as the ring draws it (B, Hkv, G=1, T, T)
    keep = dropout.keep(0, 0, 0, (2, 4, 1, 64, 64), torch.device("cuda")).view(2, 4, 64, 64)
    ref = [t.double().clone().requires_grad_() for t in (q, k, v)]
    scores = (ref[0] @ ref[1].transpose(-1, -2) / 8).masked_fill(
        ~torch.ones(64, 64, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    want = (torch.softmax(scores, -1) * keep / 0.7) @ ref[2]
    want.backward(grad.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), expected.grad, rtol=1e-5, atol=1e-5)
