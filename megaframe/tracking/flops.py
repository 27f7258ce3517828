"""Model FLOPs per token (PaLM, appendix B): 6·N + 12·L·h·s."""
from __future__ import annotations

from typing import Optional

from megaframe.model.dims import GPTDims

# Dense (not sparse) bf16 peaks, TFLOP/s per device, from the vendors' datasheets. Dividing by the
# sparse figure (1979 for H100) halves MFU, a frequent complaint about other frameworks.
# First match wins, so the more specific names come first.
DENSE_BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def matmul_parameters(dims: GPTDims) -> int:
    """N of the PaLM formula: every parameter that takes part in a matmul per token.

    The input embedding tables are lookups, not matmuls, so they are excluded; the LM head is a
    matmul over the (padded) vocabulary even when its weight is tied to the input embedding.
    """
    h, f, hs = dims.hidden_size, dims.ffn_hidden_size, dims.head_dim
    attn = h * dims.num_heads * hs + 2 * h * dims.num_kv_heads * hs + dims.num_heads * hs * h
    mlp = (3 if dims.activation == "swiglu" else 2) * h * f
    return dims.num_layers * (attn + mlp) + dims.padded_vocab_size * h


def flops_per_token(dims: GPTDims) -> float:
    """Training FLOPs per token (forward + backward), attention scores included."""
    return 6.0 * matmul_parameters(dims) + 12.0 * dims.num_layers * dims.hidden_size * dims.seq_length


def peak_tflops(configured: Optional[float]) -> Optional[float]:
    """The dense peak to compute MFU against: hardware.peak_tflops, else the GPU's from the table.

    None on CPU (there is no standard CPU peak) and on unknown GPUs: MFU is then not reported.
    """
    if configured:
        return configured
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in DENSE_BF16_PEAK_TFLOPS if key in name), None)
