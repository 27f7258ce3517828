"""The fused block kernel ring attention uses (parallel/attention_blocks.py), against full causal
SDPA: the keys cut into an earlier block (no mask) and a diagonal block (causal), each through the
kernel, merged by log-sum-exp; each block's backward given the merged output and log-sum-exp. The
sum of the blocks' gradients must be full attention's. tests/gpu runs the same on CUDA in bf16."""
from __future__ import annotations

import pytest
import torch

from attention_blocks_check import blocks_against_full_attention
from megaframe.parallel.attention_blocks import block_kernel


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.float64, 1e-12), (torch.bfloat16, 0.05)])
def test_blocks_through_the_cpu_kernel_merge_to_full_attention(dtype, tolerance):
    worst = blocks_against_full_attention("cpu", dtype)
    assert max(worst.values()) < tolerance, worst


def test_no_fused_kernel_on_a_device_without_one():
    assert block_kernel(torch.empty(1, 1, 2, 8, device="meta")) is None
