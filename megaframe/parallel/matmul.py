"""The one seam for the model's weight matmuls: every linear of the model (column-, row- and
replicated-parallel, the vocabulary-parallel LM head, the router) and the experts' grouped GEMM
call a MatmulRecipe here, never torch's matmuls directly (tests/unit/test_architecture.py).

The recipe is the local GEMM only: the TP layers keep their collectives (mappings.py) around it.
It is chosen once, before the model is built (and compiled), and travels on the TPGroup every
layer takes (`TPGroup.matmul`, set by ParallelState.tp_region / build_model(matmul=...)); each
layer fixes its MatmulSite when built, so a recipe knows at every call what a precision recipe
such as fp8 must know to compute what tp=1 computes:

- `kind`: which matmul this is (KINDS); `spans_tp(kind)` says which operands are pieces of a
  tensor split over the TP ranks, whose scale (an amax) must be reduced over `site.tp.group`
  (Megatron's TP amax reduction): a column-parallel or head weight is split by rows, a
  row-parallel GEMM by its reduction dimension (input and weight), expert GEMMs and the router
  see 1/tp of the tokens each;
- `site.tp`: the layer's TPGroup (group, size, rank, sequence_parallel).

The default recipe makes exactly the calls the model made before the seam (bitwise the same
curves). A new recipe is a subclass here (fp8's: parallel/fp8/, named in its FP8_RECIPES) plus its
config key and the planner's peak table.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

# column: weight split by output rows over TP, input whole on every TP rank (entered/gathered)
# row: weight and input split along the reduction dimension; partial outputs summed after
# replicated: a whole weight on every TP rank on the same input (kv heads when tp exceeds them)
# head: the vocabulary-parallel LM head (its own or the tied embedding): column-split vocabulary
# router: the MoE router, in fp32 (recipes that lower precision leave it alone)
# experts: the grouped expert GEMM (and its per-expert fallback); whole experts, 1/tp of the tokens
KINDS = ("column", "row", "replicated", "head", "router", "experts")

# which operands of each kind are pieces of a tensor whose other pieces lie on the other TP ranks
_SPANS_TP = {"column": ("weight",), "head": ("weight",), "row": ("input", "weight"),
             "replicated": (), "router": ("input",), "experts": ("input",)}


def spans_tp(kind: str) -> tuple[str, ...]:
    """The operands ("input", "weight") of a `kind` matmul that are split over the TP group, so
    that a tensorwise scale of them is an amax reduced over site.tp.group (at tp > 1)."""
    return _SPANS_TP[kind]


# which GEMM dimension of a linear of each kind is split over TP: "out" (the output features: the
# output and its gradient are pieces too, and the grad-input GEMM sums over the split), "in" (the
# reduction dimension of the forward GEMM), None (nothing of the local GEMM is a piece)
_TP_SPLIT = {"column": "out", "head": "out", "row": "in", "replicated": None, "router": None, "experts": None}


def tp_split(kind: str) -> Optional[str]:
    """The dimension of a `kind` linear's GEMM split over TP ("in", "out" or None): a scale whose
    amax runs over it spans the TP ranks (a tensorwise scale of a split tensor, a rowwise scale
    along a split reduction dimension) and is reduced over site.tp.group to compute what tp=1 does."""
    return _TP_SPLIT[kind]


@dataclass(frozen=True)
class MatmulSite:
    """One weight matmul of the model, fixed when its layer is built: what it is and its TPGroup."""

    kind: str
    tp: Any  # parallel.layers.TPGroup (not imported: layers imports this module)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown matmul kind {self.kind!r}; one of {KINDS}")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x Wᵀ + b through the model's recipe."""
        return self.tp.matmul.linear(x, weight, bias, self)

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows of x grouped by expert times each expert's (out, in) weight, through the recipe."""
        return self.tp.matmul.grouped_mm(x, weight, offsets, self)


@dataclass(frozen=True)
class MatmulRecipe:
    """The default recipe: torch's matmuls in the model's dtype, as megaframe always computed them.
    Stateless and frozen: one instance serves every layer and rank (no mutable global)."""

    name: str = "default"

    def for_layer(self, layer: Any) -> "MatmulRecipe":
        """The recipe of the matmuls of `layer` (an entry of model/layer_list.py's list), asked once
        as it is built: a precision recipe keeps some layers in the model's dtype (fp8's bf16_layers)."""
        return self

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               site: MatmulSite) -> torch.Tensor:
        """x (..., in) times weight (out, in) plus bias (out,) -> (..., out), at `site`."""
        return F.linear(x, weight, bias)

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   site: MatmulSite) -> torch.Tensor:
        """x (M, in) whose rows [offsets[g-1], offsets[g]) belong to expert g, times weight
        (E, out, in) -> (M, out): one grouped GEMM (offsets int32, cumulative)."""
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


DEFAULT = MatmulRecipe()


def gemm(a: torch.Tensor, b: torch.Tensor, fp8_kernel: bool = False) -> torch.Tensor:
    """a (M, K) times b (K, N): the GEMM a recipe's own autograd functions call (parallel/fp8/), so
    that torch's matmuls stay in this file. On torchao's float8 tensors it dispatches to
    torch._scaled_mm (fp8_kernel: the recipe is not emulated), or to its emulation in the tensors'
    original dtype.

    On a CPU host with AMX, torch's CPU _scaled_mm takes oneDNN's fp8 path, a reference loop (BENCHMARKS.md,
    "fp8 kernels on the CPU": hundreds of times slower than an fp32 GEMM); with oneDNN off torch takes its
    own CPU kernel, as on other hosts: the fp8 operands upcast to fp32, scaled, one fp32 GEMM, the same
    products summed in another order. So fp8 kernels on the CPU run with oneDNN off for that one call;
    a GPU, the emulated recipes and compiled graphs are untouched. The switch is the process's: the
    step's GEMMs run on one thread (forward and backward alike), which nothing else toggles meanwhile.
    """
    if fp8_kernel and a.device.type == "cpu" and not torch.compiler.is_compiling():
        with onednn_off():
            return torch.mm(a, b)
    return torch.mm(a, b)


@contextmanager
def onednn_off() -> Iterator[None]:
    """torch's CPU kernels without oneDNN inside, the switch as it was after (gemm's fp8 kernels on
    the CPU; the CUDA-shaped test device's _scaled_mm emulation, so that both do one arithmetic)."""
    onednn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = onednn
