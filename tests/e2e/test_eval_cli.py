"""megaframe-eval: a checkpoint's loss on a dataset equals what its training run evaluated there,
whichever layout wrote it; and megaframe.load_model gives that model as a plain module."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, TINY, assert_ok, cli_env, curve, read_metrics, run_cli

pytestmark = pytest.mark.slow
SAME_SAMPLES = ["parallel.micro_batch_size=2", "parallel.global_batch_size=8", "train.eval_steps=1"]  # TINY's


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaframe.eval_cli", *args], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("layout", [[], ["parallel.dp=2", "zero=stage2"]], ids=["dp1", "dp2-zero2"])
def test_a_checkpoints_loss_is_its_runs_last_eval_loss(tmp_path, layout):
    """The trainer evaluates through its engine; megaframe-eval through the plain module loaded from
    the layout-free files: the same samples give the same loss (fp32, one order apart)."""
    run_dir = tmp_path / "run"
    assert_ok(run_cli([*TINY, *layout, "train.max_steps=4", "train.eval_interval=4", f"hydra.run.dir={run_dir}"]))
    step, eval_loss = curve(read_metrics(run_dir), "eval_loss")[-1]
    assert step == 4
    result = run_eval(str(run_dir / "checkpoints"), *SAME_SAMPLES, "--json")
    assert_ok(result)
    got = json.loads(result.stdout)
    assert got["checkpoint"].endswith("global_step4") and got["samples"] == 8 and got["tokens_per_sample"] == 32
    assert got["loss"] == pytest.approx(eval_loss, rel=1e-5), (got, eval_loss)


def test_load_model_gives_the_trained_module_and_bad_input_is_one_line(tmp_path):
    import torch

    import megaframe

    run_dir = tmp_path / "run"
    assert_ok(run_cli([*TINY, "train.max_steps=2", "train.eval_interval=0", f"hydra.run.dir={run_dir}"]))
    model = megaframe.load_model(run_dir / "checkpoints")
    assert isinstance(model, torch.nn.Module) and not model.training
    assert model.embed.tok.weight.shape[0] == 257  # on the CPU: the byte vocabulary, unpadded
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, loss = model.logits(ids[:, :-1]), model(ids[:, :-1], ids[:, 1:])
    assert logits.shape == (2, 31, 257)
    manual = torch.nn.functional.cross_entropy(logits.reshape(-1, 257), ids[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(manual.item(), rel=1e-6)

    result = run_eval(str(run_dir / "checkpoints"), "model.num_layers=2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "megaframe-eval: error: model.num_layers: the model comes from the checkpoint; megaframe-eval takes "
        "data.*, train.eval_steps, parallel.micro_batch_size and parallel.global_batch_size"]
    result = run_eval(str(tmp_path / "nothing-here"))
    assert result.returncode == 2 and "not a layout-free megaframe checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_eval(str(run_dir / "checkpoints"))  # the defaults: a human line
    assert_ok(result)
    assert result.stdout.startswith("megaframe-eval: ") and "perplexity" in result.stdout
