"""The planner's step time divides the step's FLOPs by the cluster's peak in the plan's precision."""
from __future__ import annotations

import pytest
import torch

from megaframe.config.compose import compose
from megaframe.plan.cli import plan, planned_world_size


def _step_time(*overrides: str) -> float:
    cfg, _ = compose(["recipe=llama2_7b", "cluster=h100_80g", *overrides])
    _, est, _ = plan(cfg, planned_world_size(cfg))
    return est.step_time_s


def test_a_profiles_step_time_uses_its_gpus_peak_in_the_plans_precision(tf32_restored):
    """cluster=h100_80g names its GPU: the same FLOPs take 989/66.9 times longer in fp32 (TF32 off,
    torch's default) than in bf16. The profile once gave one peak, bf16's, to every precision."""
    torch.backends.cuda.matmul.allow_tf32 = False
    bf16, fp32 = _step_time("precision=bf16"), _step_time("precision=fp32")
    assert fp32 / bf16 == pytest.approx(989.0 / 66.9)
    # precision.tf32=true: the fp32 matmuls on TF32 tensor cores, half the bf16 rate
    assert _step_time("precision=fp32", "precision.tf32=true") / bf16 == pytest.approx(989.0 / 494.7)
    # a peak given by hand is used as given, in every precision
    assert _step_time("precision=bf16", "cluster.peak_tflops=500") == _step_time("precision=fp32", "cluster.peak_tflops=500")
