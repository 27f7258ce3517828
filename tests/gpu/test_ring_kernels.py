"""Ring attention's CUDA block kernel (FlashAttention-2 through aten, parallel/attention_blocks.py):
blocks merged by log-sum-exp equal full causal attention, forward and backward, in bf16 and fp16
(the CPU twin: tests/unit/parallel/test_attention_blocks.py). Not yet run on a GPU."""
from __future__ import annotations

import pytest
import torch

from attention_blocks_check import blocks_against_full_attention
from megaframe.parallel.attention_blocks import CUDA_FLASH, block_kernel


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.05), (torch.float16, 0.01)])
def test_blocks_through_the_cuda_kernel_merge_to_full_attention(dtype, tolerance):
    assert block_kernel(torch.empty(1, 1, 2, 16, device="cuda", dtype=dtype)) is CUDA_FLASH
    worst = blocks_against_full_attention("cuda", dtype)
    assert max(worst.values()) < tolerance, worst
