"""Mixture-of-Experts through megaframe-train: a self-launched ep=2 run whose checkpoint resumes at
ep=1 and continues the curve, the router metrics in metrics.jsonl, bias balancing's biases kept
across a resume, and the one-line refusals of what MoE does not take."""
from __future__ import annotations

import json

import pytest

from tests.support.helpers import TINY, assert_ok, read_metrics, run_cli
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
ARGS = [*TINY, "model=moe_tiny", "train.max_steps=8", "train.eval_interval=4", "train.save_interval=4"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted one-rank run of ARGS that both resume directions continue (trained once; read only)."""
    run_dir = tmp_path_factory.mktemp("moe") / "whole"
    assert_ok(run_cli([*ARGS, f"hydra.run.dir={run_dir}"]))
    return run_dir


def test_an_ep2_checkpoint_resumes_at_ep1_and_continues_the_curve(tmp_path, whole):
    parts = tmp_path / "parts"
    result = run_cli([*ARGS, "parallel.dp=2", "parallel.ep=2", "zero=stage1", "train.exit_at_step=4",
                      f"hydra.run.dir={parts}"])
    assert_ok(result)
    assert "launching 2 ranks" in result.stdout and "dp=2 ep=2" in result.stdout
    assert "moe=2 blocks x 8 experts top-2 dropless" in result.stdout
    result = run_cli([*ARGS, f"hydra.run.dir={parts}"])  # one rank holding all 8 experts now
    assert_ok(result)
    assert "at step 4" in result.stdout
    metrics = read_metrics(parts)
    assert_parity(metrics, read_metrics(whole), "ep=2 -> ep=1 resume")
    router = [r for r in metrics if "moe/aux_loss" in r]
    assert len(router) == 8 and all(r["moe/max_load"] >= 1.0 and r["moe/dropped_fraction"] == 0 for r in router)
    # the aux loss is about coeff * 1 for a near-balanced router: 0.01 in moe_tiny
    assert all(0.005 < r["moe/aux_loss"] < 0.1 for r in router), router[0]


def test_an_ep1_checkpoint_resumes_at_ep2_under_zero3(tmp_path, whole):
    """The other direction, into ZeRO-3: each rank loads its 4 of the 8 experts into the partition
    it holds of them (over its expert-data-parallel ranks), and the curve continues."""
    parts = tmp_path / "parts"
    assert_ok(run_cli([*ARGS, "zero=stage1", "train.exit_at_step=4", f"hydra.run.dir={parts}"]))
    result = run_cli([*ARGS, "parallel.dp=2", "parallel.ep=2", "zero=stage3", f"hydra.run.dir={parts}"])
    assert_ok(result)
    assert "at step 4" in result.stdout and "zero=3" in result.stdout
    assert_parity(read_metrics(parts), read_metrics(whole), "ep=1 -> ep=2 ZeRO-3 resume")


def test_bias_balancing_biases_survive_a_resume(tmp_path):
    balanced = ["model.moe.bias_update_rate=0.001", "model.moe.aux_loss_coeff=0"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert_ok(run_cli([*ARGS, *balanced, f"hydra.run.dir={whole}"]))
    # saved by two pipeline stages (each holds half the biases), resumed on one rank
    assert_ok(run_cli([*ARGS, *balanced, "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "train.exit_at_step=4",
                       f"hydra.run.dir={parts}"]))
    state = json.loads((parts / "checkpoints" / "global_step4" / "state.json").read_text())
    assert any(b != 0 for biases in state["router_biases"].values() for b in biases)
    assert_ok(run_cli([*ARGS, *balanced, f"hydra.run.dir={parts}"]))
    assert_parity(read_metrics(parts), read_metrics(whole), "bias balancing resume")


@pytest.mark.parametrize("extra, message", [
    (["model=llama_tiny", "parallel.dp=2", "parallel.ep=2"], "parallel.ep=2 needs experts to split; set model.moe.num_experts"),
    (["parallel.dp=3", "parallel.ep=3", "parallel.global_batch_size=6"], "parallel.ep=3 must divide model.moe.num_experts=8"),
    (["parallel.dp=2", "parallel.ep=4"], "parallel.ep=4 must divide dp*cp=2"),
    (["model.moe.top_k=9"], "model.moe.top_k=9 must be between 1 and model.moe.num_experts=8"),
    (["parallel.pp=2", "precision=fp16"], "parallel.pp > 1 with model.moe does not take precision=fp16 yet"),
    (["parallel.dp=2", "parallel.ep=2", "train.native_checkpoint=true"],
     "parallel.ep=2 checkpoints only in the layout-free format"),
    (["parallel.dp=2", "parallel.ep=2", "precision=bf16"],
     "parallel.ep=2 with precision=bf16 at zero=stage0 cannot save its experts"),
    (["model.moe.router_score=relu"], "model.moe.router_score='relu' is not one of ['softmax', 'sigmoid']"),
])
def test_what_moe_does_not_take_is_one_line_before_launch(extra, message, tmp_path):
    result = run_cli([*ARGS, *extra, f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "launching" not in result.stdout


def test_bias_balancing_with_a_dense_pipeline_stage_trains_and_saves(tmp_path):
    """model.moe.first_dense_layers=1 at pp=2: stage 0 holds no MoE layer. The biases' all-reduce
    (every step) and their gather over the stages (every save) are joined by that stage too, with
    zeros (it waited for none before, and the MoE stage waited for it until the collective timeout);
    the curve is the one-rank run's."""
    balanced = ["model.moe.bias_update_rate=0.001", "model.moe.aux_loss_coeff=0", "model.moe.first_dense_layers=1",
                "train.collective_timeout_s=60", "train.max_steps=4", "train.save_interval=2"]
    whole, staged = tmp_path / "whole", tmp_path / "staged"
    assert_ok(run_cli([*ARGS, *balanced, f"hydra.run.dir={whole}"]))
    assert_ok(run_cli([*ARGS, *balanced, "parallel.pp=2", f"hydra.run.dir={staged}"], timeout=300))
    state = json.loads((staged / "checkpoints" / "global_step4" / "state.json").read_text())
    assert any(b != 0 for biases in state["router_biases"].values() for b in biases), state["router_biases"]
    assert_parity(read_metrics(staged), read_metrics(whole), "bias balancing with a dense pp stage")
