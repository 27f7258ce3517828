"""Data parallelism through the real CLI on gloo: dp=2, self-launched and under torchrun,
reproduces the single-rank curve (same global batch) within rtol 1e-5 in fp32.

The launch paths are what this file tests; every ZeRO stage at dp=2 and dp=4 is compared in one set
of ranks in test_zero.py, so each launcher runs one stage here (a CLI run costs a process start)."""
from __future__ import annotations

import pytest

from helpers import TINY, assert_ok, read_metrics, run_cli
from parity import assert_parity

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=5"]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    result = run_cli([*TINY, *STEPS, f"hydra.run.dir={run_dir}"])
    assert_ok(result)
    return read_metrics(run_dir)


@pytest.mark.parametrize("launch,stage", [("self", 1), ("torchrun", 3)])
def test_dp2_matches_single_rank(single_rank, launch, stage, tmp_path):
    args = [*TINY, *STEPS, f"zero=stage{stage}", f"hydra.run.dir={tmp_path}"]
    if launch == "self":
        result = run_cli([*args, "parallel.dp=2"])
        assert "launching 2 ranks" in result.stdout
    else:
        result = run_cli(args, launcher=TORCHRUN)
    assert_ok(result)
    records = read_metrics(tmp_path)
    assert_parity(records, single_rank, f"dp=2 {launch} zero{stage}", keys=("loss", "grad_norm", "eval_loss", "lr"))
    # the run really had two data-parallel ranks
    assert "dp=2" in result.stdout
