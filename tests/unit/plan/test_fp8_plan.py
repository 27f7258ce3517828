"""precision=fp8 in the plan and in MFU: the fp8 share of the FLOPs is the linears the fp8 recipe
takes (read off a model built with it), that share runs at the GPU's fp8 peak in the step time,
MFU stays against the bf16 peak with mfu_fp8 beside it, and the per-matmul casts are working memory."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megaframe.config.compose import compose
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.fp8 import recipe_for
from megaframe.parallel.matmul import DEFAULT, MatmulRecipe, MatmulSite
from megaframe.parallel.state import ParallelState
from megaframe.plan.cli import plan, planned_world_size
from megaframe.tracking.flops import device_peak_tflops, flops_per_token, fp8_flops_per_token

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


def _plan(*keys: str):
    cfg, _ = compose(["recipe=llama2_7b", *keys])
    return plan(cfg, planned_world_size(cfg))[1]


def test_the_fp8_share_runs_at_the_fp8_peak():
    """H100: the fp8 linears at 1979 TFLOP/s, attention scores and the bf16 head at 989; bf16_layers
    leaves the outer blocks out of the share; a peak given by hand is every precision's."""
    bf16 = _plan("cluster=h100_80g", "precision=bf16")
    fp8 = _plan("cluster=h100_80g", "precision=fp8")
    share = fp8.fp8_flops_per_step / fp8.flops_per_step
    assert 0.5 < share < 1
    assert fp8.step_time_s == pytest.approx(bf16.step_time_s * ((1 - share) + share * 989 / 1979))
    # bf16_layers=15 of 32 blocks: two blocks' linears in fp8
    assert _plan("cluster=h100_80g", "precision=fp8", "precision.fp8.bf16_layers=15").fp8_flops_per_step == \
        pytest.approx(fp8.fp8_flops_per_step * 2 / 32)
    head = _plan("cluster=h100_80g", "precision=fp8", "precision.fp8.head=true")
    assert head.fp8_flops_per_step > fp8.fp8_flops_per_step and head.step_time_s < fp8.step_time_s
    assert _plan("cluster=h100_80g", "precision=fp8", "cluster.peak_tflops=500").step_time_s == \
        pytest.approx(_plan("cluster=h100_80g", "precision=bf16", "cluster.peak_tflops=500").step_time_s)
    # an A100 has no fp8 tensor cores: the same time as bf16; emulated matmuls likewise
    assert _plan("cluster=a100_80g", "precision=fp8").step_time_s == pytest.approx(
        _plan("cluster=a100_80g", "precision=bf16").step_time_s)
    assert _plan("cluster=h100_80g", "precision=fp8", "precision.fp8.emulate=true").step_time_s == \
        pytest.approx(bf16.step_time_s)


def test_fp8_peaks():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1979.0
    assert device_peak_tflops("NVIDIA H200", "fp8") == 1979.0
    assert device_peak_tflops("NVIDIA B200", "fp8") == device_peak_tflops("NVIDIA B200", "mxfp8") == 4500.0
    assert device_peak_tflops("NVIDIA B200", "bf16") == 2250.0
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "mxfp8") is None  # Hopper has no MXFP8 tensor cores
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None


def test_fp8_casts_are_working_memory_of_the_largest_linear():
    """torchao casts per matmul: one linear's fp8 copies (weight, input, output gradient) live at a
    time, a byte per element; activations stay bf16 (the plan's act/micro does not change)."""
    bf16 = _plan("cluster=h100_80g", "precision=bf16").stages[0]
    fp8 = _plan("cluster=h100_80g", "precision=fp8").stages[0]
    tokens, h, f = 4096, 4096, 11008  # llama2_7b: micro-batch 1 of 4096 tokens; the MLP is its widest linear
    assert fp8.activations_per_micro_batch == bf16.activations_per_micro_batch
    assert fp8.working - bf16.working == h * f + tokens * (h + f)


def _step_record(*keys: str):
    from megaframe.training.reporting import StepRecord

    cfg = compose(["cluster=h100_80g", *keys])[0]
    dims = resolve_dims(cfg.model, 96)
    trainer = SimpleNamespace(cfg=cfg, dims=dims, layout=SimpleNamespace(global_batch_size=8, world_size=1, dp=1),
                              backend=SimpleNamespace(device=torch.device("cuda"), grad_norm=lambda: 1.0,
                                                      precision_state=dict, router_metrics=dict),
                              step=1, consumed_samples=8, guard=SimpleNamespace(skipped_steps=0),
                              data=SimpleNamespace(blended=False))
    record = StepRecord(trainer, SimpleNamespace())
    record.steps, record.seconds = 1, 1.0
    return record.record(1.0, 1.0, 1e-3), flops_per_token(dims) * 8 * cfg.model.seq_length / 1e12, dims, cfg


def test_mfu_is_against_the_bf16_peak_with_the_fp8_figure_beside_it():
    row, tflops, dims, cfg = _step_record("precision=fp8")
    assert row["mfu"] == pytest.approx(tflops / 989)
    share = fp8_flops_per_token(dims, cfg.precision.fp8) / flops_per_token(dims)
    assert row["mfu_fp8"] == pytest.approx(tflops / (1 / ((1 - share) / 989 + share / 1979)))
    assert "mfu_fp8" not in _step_record("precision=bf16")[0]
