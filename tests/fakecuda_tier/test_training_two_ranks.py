"""megaframe-train on the CUDA-shaped device (tests/support/fakecuda): as a user runs it on GPUs (DeepSpeed on a
`cuda` accelerator, every tensor of the step loop on cuda:N, collectives refusing host tensors), with
no change to megaframe. Each run must finish with no violation in any process and the plain CPU
run's curve (loss, gradient norm, eval loss at rtol 1e-5 in fp32). The ranks start as the e2e tests
start them (python -m megaframe.train, self-launched through torchrun for two ranks), each installing
the device from tests/support/fakecuda/sitecustomize.py. This file: two ranks (dp at ZeRO-0 to 3, tp with and without SP, pp, Ulysses)."""
from __future__ import annotations

import pytest

from tests.support.fakecuda.runs import run_on_device
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
TWO_RANKS = {"dp2-zero0": ["parallel.dp=2", "zero=stage0"], "dp2-zero1": ["parallel.dp=2", "zero=stage1"],
             "dp2-zero2": ["parallel.dp=2", "zero=stage2"], "dp2-zero3": ["parallel.dp=2", "zero=stage3"],
             "tp2-zero1": ["parallel.tp=2", "zero=stage1"], "pp2-zero1": ["parallel.pp=2", "zero=stage1"],
             "tp2-sp-zero1": ["parallel.tp=2", "parallel.sequence_parallel=true", "zero=stage1"],
             # ZeRO-2 over the cp group (ZeRO shards over dp x cp)
             "cp2-ulysses-zero2": ["parallel.cp=2", "parallel.cp_impl=ulysses", "zero=stage2"]}


@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_two_ranks_train_on_the_device_with_the_cpu_curve(case, cpu_reference, tmp_path):
    metrics = run_on_device(tmp_path, case, TWO_RANKS[case], world=2)
    assert_parity(metrics, cpu_reference, f"fakecuda {case}")
