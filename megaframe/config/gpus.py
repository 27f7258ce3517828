"""The GPUs megaframe knows the dense peaks of: cluster.gpu names one, and MFU and the planner's step
time divide by its peak in the run's matmul precision (tracking/flops.py)."""
from __future__ import annotations

# Dense (not sparse) peaks, TFLOP/s per device, by the precision the matmuls run in, from the
# vendors' datasheets. Dividing by the sparse figure (1979 for H100) halves MFU, a frequent
# complaint about other frameworks; dividing an fp32 run by the bf16 peak understates it 15x.
# First match wins, so the more specific names come first.
DENSE_PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
)


def known_gpu(name: str) -> bool:
    """Whether cluster.gpu names a GPU of DENSE_PEAK_TFLOPS exactly (H100, H100 PCIe, H200, A100)."""
    return any(name == key for key, _ in DENSE_PEAK_TFLOPS)
