"""The GPUs megaframe knows the dense peaks of: cluster.gpu names one, and MFU and the planner's step
time divide by its peak in the run's matmul precision (tracking/flops.py)."""
from __future__ import annotations

# Dense (not sparse) peaks, TFLOP/s per device, by the precision the matmuls run in, from the
# vendors' datasheets. Dividing by the sparse figure (1979 for H100's bf16) halves MFU, a frequent
# complaint about other frameworks; dividing an fp32 run by the bf16 peak understates it 15x.
# fp8: e4m3/e5m2 tensor cores (Hopper's H100/H200 SXM 1979 dense, 3958 with sparsity; H100 PCIe
# 1513); mxfp8: OCP microscaled fp8 (1x32 blocks), which only Blackwell's tensor cores run natively
# (Hopper emulates it, at no fp8 rate: no entry). A100 has no fp8 tensor cores (no entry: an fp8
# share of the FLOPs then counts at the bf16 peak, tracking/flops.py).
# B200 (HGX B200, 1000 W): NVIDIA's HGX B200 datasheet gives per GPU "FP8/FP6 Tensor Core 9 PFLOPS",
# "FP16/BF16 4.5 PFLOPS", "TF32 2.2 PFLOPS" with sparsity, halved here to the dense 4500, 2250 and
# 1100 (FP32 75); MXFP8 runs at the FP8 rate on Blackwell's fifth-generation tensor cores (NVIDIA's
# Blackwell architecture brief), so 4500 dense too.
# First match wins, so the more specific names come first.
DENSE_PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2, "fp8": 1513.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9, "fp8": 1979.0}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9, "fp8": 1979.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0, "fp8": 4500.0, "mxfp8": 4500.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
)


def known_gpu(name: str) -> bool:
    """Whether cluster.gpu names a GPU of DENSE_PEAK_TFLOPS exactly (H100, H100 PCIe, H200, B200, A100)."""
    return any(name == key for key, _ in DENSE_PEAK_TFLOPS)
