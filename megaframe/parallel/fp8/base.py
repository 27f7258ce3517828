"""What every fp8 recipe shares: which matmuls it takes (not the fp32 router, not the LM head unless
asked, not the first and last precision.fp8.bf16_layers blocks) and the default arithmetic for the
rest. Imports no torchao."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megaframe.parallel.matmul import DEFAULT, MatmulRecipe, MatmulSite


@dataclass(frozen=True)
class Fp8Recipe(MatmulRecipe):
    """A recipe that computes some of the model's matmuls in fp8 (subclasses: fp8_linear /
    fp8_grouped_mm); everything it does not take computes as the default recipe does."""

    name: str = "fp8"
    emulate: bool = True  # dequantise and multiply in the model's dtype instead of fp8 kernels
    head: bool = False  # the LM head in fp8 too (the vocabulary's logits are sensitive: bf16 by default)
    bf16_layers: int = 0  # the first and the last this many blocks keep the default arithmetic
    num_layers: int = 0

    def for_layer(self, layer: Any) -> MatmulRecipe:
        """DEFAULT for the first and last bf16_layers blocks (Megatron's first_last_layers_bf16)."""
        if layer.kind == "block" and (layer.block < self.bf16_layers
                                      or layer.block >= self.num_layers - self.bf16_layers):
            return DEFAULT
        return self

    def takes(self, site: MatmulSite) -> bool:
        """Whether this site's linear computes in fp8: not the router (fp32 by design), the head only
        when asked, not the experts' per-expert loop (a device without a grouped GEMM: uneven row
        counts, which MXFP8's 32-row blocks do not cover; the grouped GEMM is fp8_grouped_mm's)."""
        return site.kind not in ("router", "experts") and (site.kind != "head" or self.head)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               site: MatmulSite) -> torch.Tensor:
        if not self.takes(site):
            return super().linear(x, weight, bias, site)
        out = self.fp8_linear(x, weight, site)
        return out if bias is None else out + bias.to(out.dtype)

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, site: MatmulSite) -> torch.Tensor:
        """x (..., in) times weight (out, in) in fp8, no bias."""
        raise NotImplementedError
