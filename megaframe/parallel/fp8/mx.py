"""MXFP8 (OCP microscaling: e4m3 values, one power-of-two scale per 32 consecutive elements along
the GEMM's reduction dimension) on the dense linears and the experts' grouped GEMM, through
torchao's MXFP8 training functions (prototype.moe_training), emulated on the CPU and on GPUs below
SM 10.0 where asked. A block never crosses a TP shard (the rules keep each shard's reduction
dimension a multiple of 32), so no scale spans the TP ranks: tp=2 casts what tp=1 casts."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from megaframe.parallel.fp8.base import Fp8Recipe
from megaframe.parallel.matmul import MatmulSite

BLOCK = 32  # MXFP8's block: the reduction dimensions must be multiples of it


@dataclass(frozen=True)
class MXRecipe(Fp8Recipe):
    """MXFP8 with torchao's RCEIL scales (cuBLAS's rounding), every GEMM (grad_weight too) in MXFP8."""

    name: str = "mxfp8"

    def _kernels(self) -> KernelPreference:
        return KernelPreference.EMULATED if self.emulate else KernelPreference.AUTO

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, site: MatmulSite) -> torch.Tensor:
        return _to_mxfp8_then_scaled_mm(x, weight, self._kernels(), ScaleCalculationMode.RCEIL)

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   site: MatmulSite) -> torch.Tensor:
        """The experts' grouped GEMM in MXFP8; groups padded to 32 rows (MXFP8's blocks along the
        tokens, the grad_weight GEMM's reduction dimension) inside torchao."""
        return _to_mxfp8_then_scaled_grouped_mm(x, weight.transpose(-2, -1), offs=offsets, out_dtype=x.dtype,
                                                kernel_preference=self._kernels(),
                                                pad_token_groups_for_grouped_mm=True)


def build(name: str, emulate: bool, head: bool = False, bf16_layers: int = 0, num_layers: int = 0) -> MXRecipe:
    """The MXFP8 recipe, emulated or on SM 10.0 kernels."""
    return MXRecipe(name=name, emulate=emulate, head=head, bf16_layers=bf16_layers, num_layers=num_layers)
