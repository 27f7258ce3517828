"""Model FLOPs per token (PaLM, appendix B): 6·N + 12·L·h·s, with N the active matmul parameters
(Mixture-of-Experts: a token's top_k experts, not all of them) and h the attention width
heads·head_dim (= hidden for the classic shapes; Qwen3's head_dim 128 makes it twice its hidden).

Attention counts the keys each query's mask admits, ignoring the causal triangle (PaLM's,
torchtitan's and nanochat's convention; Megatron-LM halves causal attention instead): s keys for a
global layer, min(W, s) for a layer with a sliding window W. Document masking is not credited:
the formula cannot know the documents' lengths (docs/metrics.md).

Under precision=fp8 some of those FLOPs run on fp8 tensor cores (fp8_flops_per_token); MFU stays
against the bf16 peak, and the fp8-aware peak (mixed_peak) is reported beside it."""
from __future__ import annotations

from typing import Optional

from megaframe.config.gpus import DENSE_PEAK_TFLOPS
from megaframe.model.dims import GPTDims


def _block_matmul_parameters(dims: GPTDims, moe_block: bool, experts: bool = True) -> int:
    """One block's active matmul parameters: its attention projections and its MLP, or for an MoE
    block the router, the top_k chosen experts (experts=False: left out) and the shared experts."""
    h, hs = dims.hidden_size, dims.head_dim
    attn = h * dims.num_heads * hs + 2 * h * dims.num_kv_heads * hs + dims.num_heads * hs * h
    per_width = 3 if dims.activation == "swiglu" else 2
    if not moe_block:
        return attn + per_width * h * dims.ffn_hidden_size
    moe = dims.moe
    chosen = moe.top_k if experts else 0
    return attn + moe.num_experts * h + (chosen + moe.shared_experts) * per_width * h * moe.ffn_hidden_size


def matmul_parameters(dims: GPTDims) -> int:
    """N of the PaLM formula: every parameter that takes part in a matmul per token (for MoE, the
    active ones: a token meets the router, its top_k experts and the shared experts).

    The input embedding tables are lookups, not matmuls, so they are excluded; the LM head is a
    matmul over the (padded) vocabulary even when its weight is tied to the input embedding.
    """
    moe_blocks = dims.num_moe_blocks
    return ((dims.num_layers - moe_blocks) * _block_matmul_parameters(dims, False)
            + moe_blocks * (_block_matmul_parameters(dims, True) if moe_blocks else 0)
            + dims.padded_vocab_size * dims.hidden_size)


def attention_keys(dims: GPTDims) -> int:
    """Keys per query, summed over the layers, as the attention term counts them: s for a global
    layer, min(W, s) for a windowed one (the causal triangle and the window's first W queries, which
    see fewer, are not subtracted: the convention of the causal case)."""
    windowed = dims.windowed_blocks_in(0, dims.num_layers)
    return (dims.num_layers - windowed) * dims.seq_length + windowed * (dims.sliding_window or 0)


def flops_per_token(dims: GPTDims) -> float:
    """Training FLOPs per token (forward + backward), attention scores included: QK^T and the
    weighted sum of V are heads·head_dim wide, whatever the hidden size, over attention_keys."""
    attention_width = dims.num_heads * dims.head_dim
    return 6.0 * matmul_parameters(dims) + 12.0 * attention_width * attention_keys(dims)


def fp8_matmul_parameters(dims: GPTDims, fp8) -> int:
    """Of matmul_parameters, those whose matmuls precision.fp8 (fp8: an Fp8Config) runs in fp8, as
    parallel/fp8/base.py chooses them: the blocks' linears except in the first and last
    fp8.bf16_layers blocks, not the router (fp32), the routed experts only under mxfp8 (the grouped
    GEMM), the LM head only with fp8.head. The attention scores stay in bf16."""
    if not fp8.enabled:
        return 0
    first, stop = fp8.bf16_layers, dims.num_layers - fp8.bf16_layers
    blocks = max(0, stop - first)
    moe_blocks = dims.moe_blocks_in(first, stop) if blocks else 0
    experts = fp8.recipe == "mxfp8"
    total = (blocks - moe_blocks) * _block_matmul_parameters(dims, False)
    if moe_blocks:
        total += moe_blocks * (_block_matmul_parameters(dims, True, experts) - dims.moe.num_experts * dims.hidden_size)
    return total + (dims.padded_vocab_size * dims.hidden_size if fp8.head else 0)


def fp8_flops_per_token(dims: GPTDims, fp8) -> float:
    """The share of flops_per_token that runs on fp8 tensor cores (forward and both backward GEMMs
    of each fp8 linear: 6 per parameter)."""
    return 6.0 * fp8_matmul_parameters(dims, fp8)


def fp8_matmul_precision(fp8) -> str:
    """The DENSE_PEAK_TFLOPS column of an fp8 recipe: mxfp8 (Blackwell's microscaled rate) or fp8."""
    return "mxfp8" if fp8.recipe == "mxfp8" else "fp8"


def mixed_peak(peak: Optional[float], fp8_peak: Optional[float], fp8_share: float) -> Optional[float]:
    """The peak of a run whose fp8_share of FLOPs runs at fp8_peak and the rest at peak: the FLOPs
    over the time each part takes at its own peak. No fp8 peak (an A100, MXFP8 on Hopper, emulated
    matmuls): the fp8 share runs at `peak` too."""
    if not peak:
        return None
    if not fp8_peak or fp8_share <= 0:
        return peak
    return 1.0 / ((1.0 - fp8_share) / peak + fp8_share / fp8_peak)


def matmul_precision(dtype: str, tf32: bool) -> str:
    """The precision a run's matmuls execute in: bf16/fp16 as configured; fp32 runs in TF32 where
    torch allows it (torch.backends.cuda.matmul.allow_tf32 / float32_matmul_precision)."""
    return "tf32" if dtype == "fp32" and tf32 else dtype


def device_peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The dense peak of a GPU (by name) in one matmul precision; None for an unknown GPU, or one
    without that precision's tensor cores (fp8 on an A100)."""
    return next((peaks.get(precision) for key, peaks in DENSE_PEAK_TFLOPS if key in device_name), None)


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


def fp8_peak_tflops(configured: Optional[float], fp8, emulated: bool, gpu: Optional[str] = None,
                    this_gpu: bool = True) -> Optional[float]:
    """The dense peak the fp8 share of a run's FLOPs runs at (fp8: precision.fp8), looked up as
    peak_tflops looks up the bf16 one: cluster.peak_tflops as given (in every precision); the
    GPU's fp8 or mxfp8 peak. None with fp8 off, with emulated matmuls (dequantised, multiplied in
    bf16), or without that peak: mixed_peak then counts the share at the bf16 peak."""
    if not fp8.enabled or emulated:
        return None
    if configured:
        return configured
    precision = fp8_matmul_precision(fp8)
    if gpu:
        return device_peak_tflops(gpu, precision)
    import torch

    if not this_gpu or not torch.cuda.is_available():
        return None
    return device_peak_tflops(torch.cuda.get_device_name(), precision)


def fp8_aware_peak(peak: Optional[float], cluster, fp8, dims: GPTDims, device_type: str,
                   this_gpu: bool = True) -> Optional[float]:
    """The peak of a precision=fp8 run's own mix (cluster: a ClusterConfig; fp8: precision.fp8):
    its fp8 share of the model FLOPs at the GPU's fp8 (or mxfp8) peak, the rest at `peak` (the
    bf16 one MFU divides by); None with fp8 off. The planner's step time divides by it, and a run
    logs mfu_fp8 against it beside mfu."""
    if not fp8.enabled:
        return None
    from megaframe.parallel.fp8 import emulated  # torch-free

    fp8_peak = fp8_peak_tflops(cluster.peak_tflops, fp8, emulated(fp8.emulate, device_type), cluster.gpu, this_gpu)
    return mixed_peak(peak, fp8_peak, fp8_flops_per_token(dims, fp8) / flops_per_token(dims))
