"""What DeepSpeed's accelerator on this machine supports, asked before launch."""
from __future__ import annotations

from deepspeed.accelerator import get_accelerator


def device_supports_fp16() -> bool:
    """Whether DeepSpeed's accelerator on this machine accepts fp16 (CPU: only with AVX512-FP16)."""
    return bool(get_accelerator().is_fp16_supported())
