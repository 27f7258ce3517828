"""precision=fp8 in the plan: the fp8 share of the FLOPs runs at the GPU's fp8 peak in the step time,
and torchao's per-matmul casts are working memory (the share itself: tests/unit/tracking/test_fp8_flops.py)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from megaframe.config.compose import compose
from megaframe.plan.cli import plan, planned_world_size


BASE = {}


def _plan(precision: str = "bf16", cluster: Optional[dict] = None, **fp8):
    """llama2_7b's plan on cluster=h100_80g (cluster: keys replaced; fp8: precision.fp8 keys), the
    config composed once per precision and varied by hand (composition is the slow part)."""
    if precision not in BASE:
        BASE[precision] = compose(["recipe=llama2_7b", "cluster=h100_80g", f"precision={precision}"])[0]
    cfg = BASE[precision]
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, **(cluster or {})),
                              precision=dataclasses.replace(cfg.precision, fp8=dataclasses.replace(cfg.precision.fp8, **fp8)))
    return plan(cfg, planned_world_size(cfg))[1]


def test_the_fp8_share_runs_at_the_fp8_peak():
    """H100: the fp8 linears at 1979 TFLOP/s, attention scores and the bf16 head at 989; bf16_layers
    leaves the outer blocks out of the share; a peak given by hand is every precision's."""
    bf16, fp8 = _plan("bf16"), _plan("fp8")
    share = fp8.fp8_flops_per_step / fp8.flops_per_step
    assert 0.5 < share < 1
    assert fp8.step_time_s == pytest.approx(bf16.step_time_s * ((1 - share) + share * 989 / 1979))
    # bf16_layers=15 of 32 blocks: two blocks' linears in fp8
    assert _plan("fp8", bf16_layers=15).fp8_flops_per_step == pytest.approx(fp8.fp8_flops_per_step * 2 / 32)
    head = _plan("fp8", head=True)
    assert head.fp8_flops_per_step > fp8.fp8_flops_per_step and head.step_time_s < fp8.step_time_s
    given = {"peak_tflops": 500.0}
    assert _plan("fp8", given).step_time_s == pytest.approx(_plan("bf16", given).step_time_s)
    # an A100 has no fp8 tensor cores: the same time as bf16; emulated matmuls likewise
    a100 = {"gpu": "A100"}
    assert _plan("fp8", a100).step_time_s == pytest.approx(_plan("bf16", a100).step_time_s)
    assert _plan("fp8", emulate="true").step_time_s == pytest.approx(bf16.step_time_s)


def test_fp8_casts_are_working_memory_of_the_largest_linear():
    """torchao casts per matmul: one linear's fp8 copies (weight, input, output gradient) live at a
    time, a byte per element; activations stay bf16 (the plan's act/micro does not change)."""
    bf16, fp8 = _plan("bf16").stages[0], _plan("fp8").stages[0]
    tokens, h, f = 4096, 4096, 11008  # llama2_7b: micro-batch 1 of 4096 tokens; the MLP is its widest linear
    assert fp8.activations_per_micro_batch == bf16.activations_per_micro_batch
    assert fp8.working - bf16.working == h * f + tokens * (h + f)


def test_fp8_recipes_save_what_bf16_saves():
    """Why the plan's activations do not change under fp8: every recipe saves its linears' inputs and
    weights in bf16 and casts in the backward again (saved-tensor hooks on a small model)."""
    import torch

    from megaframe.model.factory import build_model, resolve_dims
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.fp8 import recipe_for
    from megaframe.parallel.state import ParallelState
    from tests.support.saved_tensors import saved_bytes

    saved = {}
    for recipe in ("bf16", "tensorwise", "rowwise", "mxfp8"):
        keys = ["precision=bf16"] if recipe == "bf16" else ["precision=fp8", f"precision.fp8.recipe={recipe}"]
        cfg = compose(["model=llama_tiny", "model.num_layers=2", *keys])[0]
        dims = resolve_dims(cfg.model, 96)
        model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=1,
                            matmul=recipe_for(cfg.precision, dims.num_layers, "cpu")).to(torch.bfloat16)
        saved[recipe] = saved_bytes(model, torch.randint(0, 96, (2, dims.seq_length),
                                                          generator=torch.Generator().manual_seed(0)))
    assert len(set(saved.values())) == 1, saved
