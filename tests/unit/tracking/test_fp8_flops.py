"""The fp8 share of the model FLOPs (tracking/flops.py) against a model built with the fp8 recipe,
and the fp8 and MXFP8 peaks of the GPU table (config/gpus.py)."""
from __future__ import annotations

import pytest

from megaframe.config.compose import compose
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.fp8 import recipe_for
from megaframe.parallel.matmul import DEFAULT, MatmulRecipe, MatmulSite
from megaframe.parallel.state import ParallelState
from megaframe.tracking.flops import device_peak_tflops, fp8_flops_per_token

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64"]


def _fp8_parameters_of_the_built_model(model, top_k: int, num_experts: int) -> float:
    """The weights whose matmuls the model's recipes run in fp8, read off its modules: a linear whose
    site's recipe takes it, an expert stack whose recipe overrides the grouped GEMM (its top_k of
    num_experts experts per token)."""
    total = 0.0
    for module in model.modules():
        # the model's own head_matmul is the tied head's seam; an untied head is a module of its own
        site = getattr(module, "matmul", None) or (model.dims.tie_embeddings and getattr(module, "head_matmul", None))
        if not isinstance(site, MatmulSite) or site.tp.matmul is DEFAULT:
            continue
        recipe = site.tp.matmul
        if site.kind == "experts":
            if type(recipe).grouped_mm is not MatmulRecipe.grouped_mm:
                total += sum(p.numel() for p in module.parameters(recurse=False)) * top_k / num_experts
        elif recipe.takes(site):
            weight = module.weight if hasattr(module, "weight") else model.embed.tok.weight  # a tied head
            total += weight.numel()
    return total


@pytest.mark.parametrize("keys", [["precision.fp8.bf16_layers=1"], ["precision.fp8.head=true"],
                                  ["precision.fp8.recipe=mxfp8", *MOE, "model.moe.shared_experts=1"],
                                  ["precision.fp8.recipe=rowwise", *MOE]])
def test_the_fp8_share_is_the_linears_the_recipe_takes(keys):
    cfg = compose(["precision=fp8", "model=llama_tiny", "model.num_layers=4", "model.tie_embeddings=false", *keys])[0]
    dims = resolve_dims(cfg.model, 96)
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=1,
                        matmul=recipe_for(cfg.precision, dims.num_layers, "cpu"))
    expected = _fp8_parameters_of_the_built_model(model, cfg.model.moe.top_k, cfg.model.moe.num_experts)
    assert expected > 0
    assert fp8_flops_per_token(dims, cfg.precision.fp8) == pytest.approx(6 * expected)


def test_fp8_peaks():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1979.0
    assert device_peak_tflops("NVIDIA H200", "fp8") == 1979.0
    assert device_peak_tflops("NVIDIA B200", "fp8") == device_peak_tflops("NVIDIA B200", "mxfp8") == 4500.0
    assert device_peak_tflops("NVIDIA B200", "bf16") == 2250.0
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "mxfp8") is None  # Hopper has no MXFP8 tensor cores
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None
