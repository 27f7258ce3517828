"""The fused block kernel ring attention uses (parallel/attention_blocks.py), against full causal
SDPA: the keys cut into an earlier block (no mask) and a diagonal block (causal), each through the
kernel, merged by log-sum-exp; each block's backward given the merged output and log-sum-exp. The
sum of the blocks' gradients must be full attention's. tests/gpu runs the same on CUDA in bf16."""
from __future__ import annotations

import pytest
import torch

from attention_blocks_check import blocks_against_full_attention, full_attention_rounding
from megaframe.parallel.attention_blocks import block_kernel
from numerics import FACTOR, FP32_EPS


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.bfloat16, 0.05)])
def test_blocks_through_the_cpu_kernel_merge_to_full_attention(dtype, tolerance):
    worst = blocks_against_full_attention("cpu", dtype)
    assert max(worst.values()) < tolerance, worst


@pytest.mark.numerics
def test_fp32_blocks_round_no_worse_than_one_fp32_sdpa_call():
    """fp32: within FACTOR x what one full SDPA call in fp32 is off fp64 on this host (its SIMD
    width and threads set both), each of output and q/k/v gradients (tests/numerics.py)."""
    worst, own = blocks_against_full_attention("cpu", torch.float32), full_attention_rounding(torch.float32)
    for name in worst:
        assert worst[name] <= FACTOR * max(own[name], FP32_EPS), (name, worst, own)


def test_no_fused_kernel_on_a_device_without_one():
    assert block_kernel(torch.empty(1, 1, 2, 8, device="meta")) is None
