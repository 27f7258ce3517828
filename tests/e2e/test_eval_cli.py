"""megaframe-eval: a checkpoint's loss on a dataset equals what its training run evaluated there,
whichever layout wrote it; and megaframe.load_model gives that model as a plain module."""
from __future__ import annotations

import json
import math
import shutil
import subprocess

import numpy as np
import pytest

from tests.support.helpers import TINY, assert_ok, curve, read_metrics, run_cli, run_module

pytestmark = pytest.mark.slow
SAME_SAMPLES = ["parallel.micro_batch_size=2", "parallel.global_batch_size=8", "train.eval_steps=1"]  # TINY's


def run_eval(*args: str) -> subprocess.CompletedProcess:
    """`python -m megaframe.eval_cli ARGS`, forked warm (helpers.run_module)."""
    return run_module("megaframe.eval_cli", list(args), timeout=300)


# a mixture of experts with DeepSeek-V3's bias balancing: the biases that pick its experts are in the
# checkpoint's state, not among its tensors (megaframe-eval scored it with them at zero)
MOE_BIASED = ["model=moe_tiny", "model.moe.bias_update_rate=0.05"]


@pytest.mark.parametrize("layout", [[], ["parallel.dp=2", "zero=stage2"], MOE_BIASED],
                         ids=["dp1", "dp2-zero2", "moe-bias-balanced"])
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
    assert result.returncode == 2 and "nothing-here: no such directory; pass a checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_eval(str(run_dir / "checkpoints"))  # the defaults: a human line
    assert_ok(result)
    assert result.stdout.startswith("megaframe-eval: ") and "perplexity" in result.stdout


def test_with_no_data_arguments_it_scores_the_runs_own_data_or_says_it_cannot(tmp_path, monkeypatch, capsys):
    """docs/char-model.md, shortened: a run on a text file of its own (train and validation parts,
    relative paths); `megaframe-eval RUN/checkpoints` alone reads data, tokenizer and batch settings
    from RUN/config.yaml and gives the run's own last eval_loss, naming the file. It once scored
    the built-in demo corpus instead (a Shakespeare model: 5.87 instead of its 1.88, exit 0)."""
    from megaframe.data.preprocess_cli import main as preprocess
    from megaframe.eval_cli import main as evaluate

    monkeypatch.chdir(tmp_path)
    words = [f"line {i}: the {'quick' if i % 3 else 'lazy'} fox {i * 7 % 13} jumps over {i % 5} dogs." for i in range(900)]
    (tmp_path / "train.txt").write_text("\n".join(words[:800]))
    (tmp_path / "val.txt").write_text("\n".join(words[800:]))
    for part in ("train", "val"):
        assert preprocess(["--input", f"{part}.txt", "--output-prefix", f"data/{part}"]) == 0
    run_dir = tmp_path / "run"
    assert_ok(run_cli([*TINY, "data.path=data/train", "data.valid_path=data/val", "train.max_steps=4",
                       "train.eval_interval=4", "train.eval_steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    step, eval_loss = curve(read_metrics(run_dir), "eval_loss")[-1]
    assert step == 4
    capsys.readouterr()

    def run(*args: str) -> tuple[int, str, str]:
        try:
            evaluate([str(run_dir / "checkpoints"), *args])
            code = 0
        except SystemExit as done:
            code = done.code
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, err = run("--json")
    assert code == 0 and not err, err
    got = json.loads(out)
    assert got["data"] == "data.valid_path=data/val" and got["config"] == str(run_dir / "config.yaml")
    assert got["loss"] == pytest.approx(eval_loss, abs=1e-4) and got["samples"] == 2 * 8  # the run's eval_steps
    assert got["bits_per_byte"] == pytest.approx(got["loss"] / math.log(2))
    code, out, err = run()
    assert code == 0 and f"on data.valid_path=data/val: loss {eval_loss:.4f}," in out, out + err

    (tmp_path / "data").rename(tmp_path / "moved")  # the run's data gone: one line naming it, exit 2
    code, out, err = run()
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
    # checked before anything loads, as megaframe-train checks it (validate.check_data): the first file gone
    assert str(run_dir / "config.yaml") in err and "data/val.bin not found" in err and "Traceback" not in err
    (tmp_path / "moved").rename(tmp_path / "data")
    (run_dir / "config.yaml").rename(tmp_path / "config.yaml")  # the run's config gone: the same
    code, out, err = run()
    assert code == 2 and not out and err.strip().splitlines() == [
        f"megaframe-eval: error: {run_dir / 'config.yaml'}: the run's config is missing, so the data it trained on "
        f"is unknown; name the data to score with data.path=PREFIX (and data.valid_path=PREFIX), data.blend=... "
        f"or data=demo"]
    # data and batch settings named: the user's (the model still comes from the checkpoint)
    code, out, err = run("data.path=data/train", "data.valid_path=data/val", "train.eval_steps=2",
                         "parallel.micro_batch_size=2", "parallel.global_batch_size=8")
    assert code == 0 and f"loss {eval_loss:.4f}" in out, err
    (tmp_path / "config.yaml").rename(run_dir / "config.yaml")
    # a checkpoint copied out of its run directory has no run config either
    shutil.copytree(run_dir / "checkpoints" / "global_step4", tmp_path / "copy")
    with pytest.raises(SystemExit) as done:
        evaluate([str(tmp_path / "copy")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path / 'copy'} (a checkpoint outside a run directory): the run's config is missing" in err, err

    # a token outside the vocabulary (a corrupt validation file): one line, exit 4, not an IndexError
    tokens = np.memmap(tmp_path / "data" / "val.bin", dtype=np.uint16, mode="r+")
    tokens[5] = 300
    tokens.flush()
    del tokens
    code, out, err = run()
    assert code == 4 and err.strip().splitlines() == [
        "megaframe-eval: error: data.valid_path=data/val: token id 300 is outside the model's vocabulary of 257; the "
        "data was tokenized with another tokenizer or is corrupt: rebuild it with megaframe-preprocess"], err
