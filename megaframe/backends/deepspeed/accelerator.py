"""What DeepSpeed's accelerator on this machine supports, asked before launch."""
from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator


def device_type() -> str:
    """Where this rank trains: DeepSpeed's accelerator ("cuda", or "cpu" under DS_ACCELERATOR=cpu)."""
    return get_accelerator().device_name()


def device_supports_fp16() -> bool:
    """Whether DeepSpeed's accelerator on this machine accepts fp16 (CPU: only with AVX512-FP16)."""
    return bool(get_accelerator().is_fp16_supported())


def device_supports_bf16() -> bool:
    """Whether the accelerator computes bf16 natively. On CUDA that starts at sm80 (Ampere): torch's
    is_bf16_supported() also says yes before that, counting emulation, which runs bf16 matmuls
    through fp32 and has no FlashAttention (DeepSpeed accepts it on that answer)."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda" and torch.cuda.is_available() and torch.version.hip is None:
        return torch.cuda.get_device_capability()[0] >= 8
    return bool(accelerator.is_bf16_supported())
