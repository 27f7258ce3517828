"""torchao's float8 training recipes (tensorwise, rowwise, rowwise_with_gw_hp: Float8LinearConfig's
casts) on megaframe's TP-sharded linears.

torchao's own matmul (float8_linear.py) computes each scale from the local tensor. Under tensor
parallelism a local tensor can be a piece: a scale whose amax runs over a dimension split across
the TP ranks (parallel/matmul.py tp_split) is then reduced (MAX) over the TP group, so that every
rank casts with the scale tp=1 would use (Megatron's TP amax reduction). The reduction is a
collective on the device, no host sync."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_training_tensor import (GemmInputRole, LinearMMConfig, ScaledMMConfig,
                                                   hp_tensor_and_scale_to_float8)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from megaframe.parallel.fp8.base import Fp8Recipe
from megaframe.parallel import mappings
from megaframe.parallel.matmul import MatmulSite, gemm, tp_split

# the GEMM dimensions of each operand: x (M, K), weight transposed (K, N), grad_output (M, N)
_X, _W_T, _GO = ("M", "K"), ("K", "N"), ("M", "N")
_SPLIT_LABEL = {"in": "K", "out": "N"}


def _amax_group(site: MatmulSite, labels: tuple[str, str], granularity: ScalingGranularity,
                axis: Optional[int]) -> Any:
    """The TP group a scale's amax is reduced over, or None when it covers nothing split: a
    tensorwise scale spans the ranks when any dimension of its tensor is split, a rowwise one when
    the dimension it runs along (axis) is."""
    split = tp_split(site.kind) if site.tp.size > 1 else None
    if split is None:
        return None
    over = labels if granularity is ScalingGranularity.TENSORWISE else (labels[axis],)
    return site.tp.group if _SPLIT_LABEL[split] in over else None


def _cast(t: torch.Tensor, cast: Any, role: GemmInputRole, axis: int, labels: tuple[str, str],
          recipe: "ScaledRecipe", site: MatmulSite) -> torch.Tensor:
    """t (2-D) as a torchao float8 tensor with a dynamic scale (tensorwise, or along `axis`), its
    amax reduced over TP where it spans the ranks; t itself where the cast is disabled."""
    if cast.scaling_type is ScalingType.DISABLED:
        return t
    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    dim = axis if axiswise else None
    amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=dim).float()
    group = _amax_group(site, labels, cast.scaling_granularity, axis)
    if group is not None:
        mappings.all_reduce_max(amax, group)  # looked up here: train.compile swaps in its eager one
    scale = amax_to_scale(amax, cast.target_dtype, recipe.config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, recipe.mm_config, role, dim)


class _Float8Linear(torch.autograd.Function):
    """x @ weight.T with torchao's three float8 GEMMs (output, grad_input, grad_weight), as
    torchao's matmul_with_hp_or_float8_args, with TP-aware scales. Saves x and weight in their own
    dtype (activation memory as in bf16)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: "ScaledRecipe", site: MatmulSite):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.site = recipe, site
        c = recipe.config
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        x_q = _cast(x2, c.cast_config_input, GemmInputRole.INPUT, -1, _X, recipe, site)
        w_q = _cast(weight.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0, _W_T, recipe, site)
        return gemm(x_q, w_q, not recipe.emulate).reshape(*x.shape[:-1], weight.shape[0])  # (..., N)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, site = ctx.recipe, ctx.site
        c = recipe.config
        go = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        go_q = _cast(go, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, _GO, recipe, site)
        w_q = _cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, _W_T, recipe, site)
        grad_x = gemm(go_q, w_q.t(), not recipe.emulate).reshape(*grad_out.shape[:-1], x.shape[-1])  # (..., K)
        go_q = _cast(go, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, _GO, recipe, site)
        x_q = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, _X,
                    recipe, site)
        grad_w = gemm(go_q.t(), x_q, not recipe.emulate)  # (N, K), the weight's own layout
        return grad_x, grad_w, None, None


@dataclass(frozen=True)
class ScaledRecipe(Fp8Recipe):
    """One of torchao's Float8LinearConfig recipes on the dense linears; the expert GEMMs keep the
    default arithmetic (MXFP8 takes those: parallel/fp8/mx.py)."""

    config: Any = None  # torchao's Float8LinearConfig for `name`
    mm_config: Any = field(default=None, compare=False)  # its LinearMMConfig (emulate, fast accumulation)

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, site: MatmulSite) -> torch.Tensor:
        return _Float8Linear.apply(x, weight, self, site)


def build(name: str, emulate: bool, head: bool = False, bf16_layers: int = 0, num_layers: int = 0) -> ScaledRecipe:
    """The recipe named `name` (tensorwise, rowwise, rowwise_with_gw_hp), emulated or on fp8 kernels."""
    config = Float8LinearConfig.from_recipe_name(name)
    mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim)
                                 for g in (config.gemm_config_output, config.gemm_config_grad_input,
                                              config.gemm_config_grad_weight)))
    return ScaledRecipe(name=name, emulate=emulate, head=head, bf16_layers=bf16_layers, num_layers=num_layers,
                        config=config, mm_config=mm_config)
