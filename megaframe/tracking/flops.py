"""Model FLOPs per token (PaLM, appendix B): 6·N + 12·L·h·s, with N the active matmul parameters
(Mixture-of-Experts: a token's top_k experts, not all of them) and h the attention width
heads·head_dim (= hidden for the classic shapes; Qwen3's head_dim 128 makes it twice its hidden)."""
from __future__ import annotations

from typing import Optional

from megaframe.config.gpus import DENSE_PEAK_TFLOPS
from megaframe.model.dims import GPTDims


def matmul_parameters(dims: GPTDims) -> int:
    """N of the PaLM formula: every parameter that takes part in a matmul per token (for MoE, the
    active ones: a token meets the router, its top_k experts and the shared experts).

    The input embedding tables are lookups, not matmuls, so they are excluded; the LM head is a
    matmul over the (padded) vocabulary even when its weight is tied to the input embedding.
    """
    h, f, hs = dims.hidden_size, dims.ffn_hidden_size, dims.head_dim
    attn = h * dims.num_heads * hs + 2 * h * dims.num_kv_heads * hs + dims.num_heads * hs * h
    per_width = 3 if dims.activation == "swiglu" else 2
    mlp = per_width * h * f
    moe_blocks = dims.num_moe_blocks
    total = dims.num_layers * attn + (dims.num_layers - moe_blocks) * mlp + dims.padded_vocab_size * h
    if moe_blocks:  # active parameters: the router, the top_k chosen experts and the shared ones
        moe = dims.moe
        total += moe_blocks * (moe.num_experts * h + (moe.top_k + moe.shared_experts) * per_width * h * moe.ffn_hidden_size)
    return total


def flops_per_token(dims: GPTDims) -> float:
    """Training FLOPs per token (forward + backward), attention scores included: QK^T and the
    weighted sum of V are heads·head_dim wide, whatever the hidden size."""
    attention_width = dims.num_heads * dims.head_dim
    return 6.0 * matmul_parameters(dims) + 12.0 * dims.num_layers * attention_width * dims.seq_length


def matmul_precision(dtype: str, tf32: bool) -> str:
    """The precision a run's matmuls execute in: bf16/fp16 as configured; fp32 runs in TF32 where
    torch allows it (torch.backends.cuda.matmul.allow_tf32 / float32_matmul_precision)."""
    return "tf32" if dtype == "fp32" and tf32 else dtype


def device_peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The dense peak of a GPU (by name) in one matmul precision; None for an unknown GPU."""
    return next((peaks[precision] for key, peaks in DENSE_PEAK_TFLOPS if key in device_name), None)


def peak_tflops(configured: Optional[float], dtype: str = "bf16", gpu: Optional[str] = None,
                this_gpu: bool = True, tf32: Optional[bool] = None) -> Optional[float]:
    """The dense peak to compute MFU and step times against, in this order: cluster.peak_tflops as
    given; the cluster profile's GPU (cluster.gpu) in the run's matmul precision (precision.dtype;
    TF32 for fp32 when torch allows it); this host's GPU the same way (this_gpu: a run measuring
    itself, or a plan for this host; not a plan for other machines). tf32: whether fp32 matmuls run
    in TF32 (None: as torch is set now).

    None on CPU (there is no standard CPU peak) and on unknown GPUs: MFU is then not reported.
    """
    if configured:
        return configured
    import torch

    precision = matmul_precision(dtype, torch.backends.cuda.matmul.allow_tf32 if tf32 is None else tf32)
    if gpu:
        return device_peak_tflops(gpu, precision)
    if not this_gpu or not torch.cuda.is_available():
        return None
    return device_peak_tflops(torch.cuda.get_device_name(), precision)
