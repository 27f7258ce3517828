"""Data parallelism through the real CLI on gloo: dp=2, self-launched and under torchrun,
reproduces the single-rank curve (same global batch) within rtol 1e-5 in fp32.

The launch paths are what this file tests; every ZeRO stage at dp=2 and dp=4 is compared in one set
of ranks in test_zero.py, so each launcher runs one stage here (a CLI run costs a process start)."""
from __future__ import annotations

import pytest

from tests.support.helpers import TINY, assert_ok, read_metrics, run_cli
from tests.support.parity import assert_parity

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


def test_dp2_async_saves_match_single_rank_and_resume(single_rank, tmp_path):
    """train.async_save at dp=2 (rank 0 publishes on its thread while both ranks train on): the curve
    equals the single-rank run's, every save is published, and a resume from the last but one
    continues the same curve."""
    args = [*TINY, *STEPS, "parallel.dp=2", "zero=stage1", "train.save_interval=2", "train.async_save=true",
            f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli(args))
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("global_step*")) == ["global_step2", "global_step4", "global_step5"]
    assert {p.name for p in (checkpoints / "global_step4").glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}
    assert_parity(read_metrics(tmp_path), single_rank, "dp=2 async saves", keys=("loss", "grad_norm", "eval_loss", "lr"))
    resumed = run_cli([*args, f"train.resume={checkpoints / 'global_step4'}"])
    assert_ok(resumed)
    assert "global_step4 at step 4" in resumed.stdout
    assert_parity(read_metrics(tmp_path), single_rank, "dp=2 async saves, resumed at 4",
                  keys=("loss", "grad_norm", "eval_loss", "lr"))
