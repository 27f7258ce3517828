"""The fused block kernel ring attention uses (parallel/attention_blocks.py), against full causal
SDPA: the keys cut into an earlier block (no mask) and a diagonal block (causal), each through the
kernel, merged by log-sum-exp; each block's backward given the merged output and log-sum-exp. The
sum of the blocks' gradients must be full attention's. tests/gpu runs the same on CUDA in bf16."""
from __future__ import annotations

import pytest
import torch

from tests.support.attention_blocks_check import blocks_against_full_attention, full_attention_rounding
from megaframe.parallel.attention_blocks import block_kernel
from tests.support.numerics import FACTOR, FP32_EPS


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.bfloat16, 0.05)])
def test_blocks_through_the_cpu_kernel_merge_to_full_attention(dtype, tolerance):
    worst = blocks_against_full_attention("cpu", dtype)
    assert max(worst.values()) < tolerance, worst


@pytest.mark.numerics
def test_fp32_blocks_round_no_worse_than_one_fp32_sdpa_call():
    """fp32: within FACTOR x what one full SDPA call in fp32 is off fp64 on this host (its SIMD
    width and threads set both), each of output and q/k/v gradients (tests/support/numerics.py)."""
    worst, own = blocks_against_full_attention("cpu", torch.float32), full_attention_rounding(torch.float32)
    for name in worst:
        assert worst[name] <= FACTOR * max(own[name], FP32_EPS), (name, worst, own)


def test_no_fused_kernel_on_a_device_without_one():
    assert block_kernel(torch.empty(1, 1, 2, 8, device="meta")) is None


@pytest.mark.parametrize("capability, head_dim, dtype, fused", [
    ((9, 0), 256, torch.bfloat16, True), ((8, 0), 128, torch.float16, True), ((8, 6), 192, torch.bfloat16, True),
    ((8, 6), 256, torch.bfloat16, False), ((8, 9), 224, torch.bfloat16, False), ((7, 5), 64, torch.float16, False),
    ((9, 0), 100, torch.bfloat16, False), ((9, 0), 64, torch.float32, False)])
def test_ring_blocks_take_flash_attention_only_where_it_runs_forward_and_backward(monkeypatch, capability, head_dim,
                                                                                  dtype, fused):
    """FlashAttention-2 on CUDA: fp16/bf16, head dim a multiple of 8, up to 256 on sm80/sm90 and 192
    on other Ampere/Ada parts, nothing before sm80; elsewhere the ring's blocks are einsums. (A
    meta tensor poses as a CUDA one: the gate reads only device, dtype and shape.)"""
    from megaframe.parallel import attention_blocks

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    monkeypatch.setattr(attention_blocks, "_flash_built", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    q = torch.empty(1, 2, 16, head_dim, dtype=dtype, device="meta").as_subclass(OnCuda)
    assert (block_kernel(q) is attention_blocks.CUDA_FLASH) is fused
