"""Muon (optim=muon) on the CUDA-shaped device (tests/support/fakecuda): its momentum, the stacked
Newton-Schulz in bf16 and the owners' exchange (optim/sharded.py: two all_to_all_single per group of
ranks, on device tensors) as a GPU job runs them: at one rank, under DeepSpeed ZeRO-1 and ZeRO-3
(the engine's flat partitions, described to Muon: backends/deepspeed/muon_zero.py), at tp=2 with
sequence parallelism under ZeRO-1 (TP pieces cut by ZeRO's partitions), and under FSDP2 (DTensor
shards), at cp=2 under ZeRO-1, and a MoE model's experts at ep=2 dp=2 under ZeRO-1 (DeepSpeed's expert
groups). Each run: no violation in any process, and the plain CPU one-rank Muon curve within
tests/dist/test_muon_layouts.py's bound (rel 1e-4: the layouts assemble the same matrices, the
gradients differ by reduction order)."""
from __future__ import annotations

import pytest

from tests.support.fakecuda.runs import assert_curves_within, cpu_run, run_on_device

pytestmark = pytest.mark.slow
MUON = ["optim=muon"]
LAYOUTS = {"one-rank": ([], 1), "dp2-zero1": (["parallel.dp=2", "zero=stage1"], 2),
           "dp2-zero3": (["parallel.dp=2", "zero=stage3"], 2),
           "tp2-sp-zero1": (["parallel.tp=2", "parallel.sequence_parallel=true", "zero=stage1"], 2),
           "fsdp2-dp2": (["backend=fsdp2", "parallel.dp=2"], 2),
           "cp2-zero1": (["parallel.cp=2", "zero=stage1"], 2)}
MOE = ["model=moe_tiny"]


@pytest.fixture(scope="module")
def muon_on_the_cpu(tmp_path_factory) -> list[dict]:
    return cpu_run(tmp_path_factory.mktemp("cpu-muon"), MUON)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_muon_trains_on_the_device_with_the_cpu_curve(case, muon_on_the_cpu, tmp_path):
    extra, world = LAYOUTS[case]
    _within_bound(run_on_device(tmp_path, case, [*MUON, *extra], world=world), muon_on_the_cpu, case)


def test_muon_steps_experts_at_ep2_under_zero1_on_the_device(tmp_path):
    cpu = cpu_run(tmp_path, [*MUON, *MOE])
    extra = [*MUON, *MOE, "parallel.dp=2", "parallel.ep=2", "zero=stage1"]
    _within_bound(run_on_device(tmp_path, "moe-ep2-zero1", extra, world=2), cpu, "moe ep2 zero1")


def _within_bound(metrics: list[dict], cpu: list[dict], case: str) -> None:
    assert_curves_within(metrics, cpu, 1e-4, case)
