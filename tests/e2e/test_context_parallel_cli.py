"""parallel.cp through megaframe-train: a self-launched cp=2 run, a checkpoint saved at cp=2 resumed
at cp=1, attention dropout under cp resumed on its own curve, and the one-line refusals of what cp
does not take."""
from __future__ import annotations

import pytest

from tests.support.helpers import TINY, assert_ok, read_metrics, run_cli
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
ARGS = [*TINY, "model=llama_tiny", "model.num_kv_heads=2", "train.max_steps=8", "train.eval_interval=4",
        "train.save_interval=4"]


def test_a_cp2_checkpoint_resumes_at_cp1_and_continues_the_curve(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert_ok(run_cli([*ARGS, f"hydra.run.dir={whole}"]))
    result = run_cli([*ARGS, "parallel.cp=2", "train.exit_at_step=4", f"hydra.run.dir={parts}"])
    assert_ok(result)
    assert "launching 2 ranks" in result.stdout and "cp=2 cp_impl=ring" in result.stdout
    result = run_cli([*ARGS, f"hydra.run.dir={parts}"])  # cp=1 now: resharded from the layout-free copy
    assert_ok(result)
    assert "at step 4" in result.stdout
    assert_parity(read_metrics(parts), read_metrics(whole), "cp=2 -> cp=1 resume")


# the ring only, for CI's time: Ulysses draws its masks from the same per-rank streams the checkpoint
# carries (its dropout resume is not run in CI)
@pytest.mark.parametrize("impl", ["ring"])
def test_dropout_under_cp_resumes_on_the_uninterrupted_curve(tmp_path, impl):
    """model.dropout=0.1 at cp=2 (attention, residual and MLP dropout): every rank's dropout streams
    are in the checkpoint, so a run resumed at step 4 draws the masks the uninterrupted run drew and
    logs the same losses; and it learns."""
    args = [*ARGS, "parallel.cp=2", f"parallel.cp_impl={impl}", "model.dropout=0.1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert_ok(run_cli([*args, f"hydra.run.dir={whole}"]))
    assert_ok(run_cli([*args, "train.exit_at_step=4", f"hydra.run.dir={parts}"]))
    result = run_cli([*args, f"hydra.run.dir={parts}"])
    assert_ok(result)
    assert "at step 4" in result.stdout
    assert_parity(read_metrics(parts), read_metrics(whole), f"cp=2 {impl} with dropout: resume")
    losses = [r["loss"] for r in read_metrics(whole) if "loss" in r]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("extra, message", [
    (["parallel.cp=3"], "model.seq_length=32 must be divisible by 2*parallel.cp=6"),
    (["parallel.cp=4", "parallel.cp_impl=ulysses"], "parallel.cp_impl=ulysses needs parallel.cp=4 to divide the 2 kv heads"),
    (["model.seq_length=36", "parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true"],
     "needs each rank's 18 tokens (model.seq_length/cp) divisible by parallel.tp=4"),
    (["parallel.cp=2", "parallel.cp_impl=zigzag"], "parallel.cp_impl='zigzag' is not one of ['ring', 'ulysses']"),
])
def test_what_cp_does_not_take_is_one_line_before_launch(extra, message, tmp_path):
    result = run_cli([*ARGS, *extra, f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "launching" not in result.stdout
