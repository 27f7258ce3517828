"""One block of ring attention through a fused attention kernel that returns its log-sum-exp.

Ring attention (parallel/context.py) computes softmax attention block by block and merges the
partial results by their log-sum-exp; its backward hands each block the *final* output and
log-sum-exp, from which a flash-style backward recomputes that block's probabilities exactly. Both
directions are what PyTorch's own fused SDPA kernels compute, so a block runs through them where
the device has one (no score matrix is materialised, no tiling is needed):

  cpu              aten._scaled_dot_product_flash_attention_for_cpu (fp32, fp64, bf16, fp16)
  cuda bf16/fp16   aten._scaled_dot_product_flash_attention (FlashAttention-2, sm80 and newer)

Elsewhere (CUDA fp32, older GPUs, other devices) block_kernel() returns None and the ring computes
its blocks with einsums over score tiles. Query heads and kv heads are equal here: the ring expands
grouped-query kv heads for the kernel and sums their gradients back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

# forward(q, k, v, causal, scale) -> (out, lse, saved); backward(dout, q, k, v, out, lse, saved, causal, scale)
# -> (dq, dk, dv). q (B, H, Tq, D), k and v (B, H, Tk, D), contiguous; out in q's dtype, lse (B, H, Tq)
# in fp32 (fp64 for fp64 inputs); `saved` is what the kernel's backward needs of its forward.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor, Any]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BlockKernel:
    """A fused attention kernel for one ring block, forward and backward."""

    name: str
    forward: Forward
    backward: Backward


def _cpu_forward(q, k, v, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(dout, q, k, v, out, lse, saved, causal: bool, scale: float):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, dk, dv


def _cuda_flash_forward(q, k, v, causal: bool, scale: float):
    # outputs: out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug mask; the
    # backward takes the middle six back (as PyTorch's own autograd formula for this op does)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_flash_backward(dout, q, k, v, out, lse, saved, causal: bool, scale: float):
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return dq, dk, dv


CPU_FLASH = BlockKernel("cpu-flash", _cpu_forward, _cpu_backward)
CUDA_FLASH = BlockKernel("cuda-flash", _cuda_flash_forward, _cuda_flash_backward)


def block_kernel(q: torch.Tensor) -> Optional[BlockKernel]:
    """The fused kernel for blocks of q's device and dtype, or None (the einsum path)."""
    if q.device.type == "cpu":
        return CPU_FLASH if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") else None
    if (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= _flash_head_dim_limit(torch.cuda.get_device_capability(q.device))
            and torch.backends.cuda.flash_sdp_enabled() and _flash_built()):
        return CUDA_FLASH
    return None


def _flash_head_dim_limit(capability: tuple[int, int]) -> int:
    """The largest head dim FlashAttention-2 runs forward and backward on this architecture: 256 on
    the datacenter parts (sm80, sm90), 192 on the others from sm80 (its backward beyond 192 needs
    their larger shared memory); 0 before sm80 (no FlashAttention-2)."""
    if capability[0] < 8:
        return 0
    return 256 if capability in ((8, 0), (9, 0)) else 192


def _flash_built() -> bool:
    """Whether this torch build has FlashAttention (ROCm and some builds do not: SDPA would fall
    back to another kernel there, while a direct call of the op would fail)."""
    available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return available is None or available()
