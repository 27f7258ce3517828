"""megaframe-train as a user types it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.helpers import REPO, TINY, assert_ok, cli_env, console_script, curve, read_metrics, run_cli, run_code
from megaframe.config.compose import compose
from tests.unit.training.test_schedule import documented_lr

pytestmark = pytest.mark.slow


def test_default_run_learns(tmp_path):
    """No arguments: the tiny GPT on the demo corpus, eval loss falls by at least 30%."""
    # about 100 s on an idle 2-core host; beside CI's other test files it ran past 600 s (-n 4)
    # as a user's shell: DS_ACCELERATOR unset; and no WANDB_MODE, which would choose W&B's mode
    env = {k: v for k, v in cli_env().items() if k not in ("DS_ACCELERATOR", "WANDB_MODE")}
    result = subprocess.run(["megaframe-train"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=1200)
    assert_ok(result)
    # DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." is a line the user cannot act on
    assert "accelerator" not in result.stdout + result.stderr, (result.stdout + result.stderr)[:2000]
    (run_dir,) = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    records = read_metrics(run_dir)
    evals = curve(records, "eval_loss")
    first, last = evals[0][1], evals[-1][1]
    assert last <= 0.7 * first, f"eval loss {first:.3f} -> {last:.3f} fell by less than 30%"
    train_record = next(r for r in records if "loss" in r)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "consumed_samples", "time"):
        assert key in train_record
    assert all("mfu" not in r for r in records)  # CPU, no cluster.peak_tflops: no peak to divide by
    assert (run_dir / "config.yaml").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "global_step300"
    # W&B is offline by default and keeps its run inside the run dir
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    # output to a pipe, as to a log file: plain lines, no bar and none of its carriage-return redraws
    assert "step 10: loss=" in result.stdout and "tok/s=" in result.stdout
    assert "\r" not in result.stdout + result.stderr and "train:" not in result.stderr


def test_llama_bf16_zero2(tmp_path):
    """The Llama flavour in bf16 under ZeRO-2 learns, at TINY's size (llama_tiny's own took 88 s of CPU)."""
    result = run_cli([*TINY, "model=llama_tiny", "precision=bf16", "zero=stage2", "train.max_steps=20",
                      "train.eval_interval=10", f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    losses = [v for _, v in curve(read_metrics(tmp_path), "loss")]
    assert losses[-1] < losses[0] - 0.5


def test_cfg_job_prints_composed_config():
    result = run_cli(["model=llama_tiny", "parallel.global_batch_size=32", "--cfg", "job"], timeout=120)
    assert_ok(result)
    assert "activation: swiglu" in result.stdout and "global_batch_size: 32" in result.stdout
    assert "hydra:" not in result.stdout


def test_train_on_preprocessed_jsonl(tmp_path):
    """The user's own corpus: preprocess a .jsonl file, then train on it."""
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20})
             for i in range(40)]
    corpus.write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "data" / "corpus"
    prep = subprocess.run([console_script("megaframe-preprocess"), "--input", str(corpus),
                           "--output-prefix", str(prefix)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_ok(prep)
    result = run_cli([*TINY, "train.max_steps=12", f"data.path={prefix}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert_ok(result)
    assert "train samples=" in result.stdout
    losses = [v for _, v in curve(read_metrics(tmp_path / "run"), "loss")]
    assert losses[-1] < losses[0]


def test_installed_wheel_finds_conf_and_recipes(tmp_path):
    """A plain (non-editable) install, used from outside the repo, carries conf/ and recipes/."""
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                              "--target", str(target), str(REPO)], capture_output=True, text=True, timeout=600)
    assert_ok(install)
    assert (target / "megaframe" / "_conf" / "config.yaml").is_file()
    assert (target / "megaframe" / "_recipes" / "llama2_7b.yaml").is_file()
    env = cli_env(PYTHONPATH=str(target))
    probe = subprocess.run([sys.executable, "-c", "import megaframe.common.paths as p; print(p.conf_dir()); print(p.recipes_dir())"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert_ok(probe)
    assert probe.stdout.split() == [str(target / "megaframe" / "_conf"), str(target / "megaframe" / "_recipes")]
    result = subprocess.run([sys.executable, "-m", "megaframe.train", "recipe=llama2_7b", "--cfg", "job"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert_ok(result)
    assert "hidden_size: 4096" in result.stdout and "ffn_hidden_size: 11008" in result.stdout


def test_tensor_parallel_from_the_command_line(tmp_path):
    """`megaframe-train parallel.tp=2` self-launches 2 ranks and its loss falls. (That tp=2, with and
    without SP, reproduces tp=1 at rtol 1e-5 is tests/dist/test_tensor_parallel.py's job, on the same Trainer.)"""
    result = run_cli([*TINY, "train.max_steps=12", "train.eval_interval=6", "parallel.tp=2",
                      "parallel.sequence_parallel=true", f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    assert "launching 2 ranks" in result.stdout and "tp=2" in result.stdout
    losses = curve(read_metrics(tmp_path), "loss")
    assert losses[-1][1] < losses[0][1] - 0.3


def test_3d_layout_from_the_command_line(tmp_path):
    """`megaframe-train parallel.tp=2 parallel.pp=2 parallel.dp=2`: 8 self-launched ranks on this machine;
    the loss reaches rank 0's metrics.jsonl, checkpoints are saved, and the terminal holds none of
    DeepSpeed's pipeline internals nor torch's warning about a broadcast without an autograd kernel
    (DeepSpeed's copy of the tied embedding, recorded by autograd: issue 51)."""
    result = run_cli(["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "train.max_steps=6", "train.eval_interval=3",
                      "train.log_interval=1", "logging.wandb.mode=disabled", f"hydra.run.dir={tmp_path}"], timeout=900)
    assert_ok(result)
    assert "launching 8 ranks" in result.stdout
    terminal = result.stdout + result.stderr
    assert not [word for word in ("SEED_LAYERS", "Using topology", "stage=1 layers=", "BlockPipe",
                                  "silently incorrect behavior", "UserWarning") if word in terminal], terminal
    assert "warning: parallel.pp=2 with 1 micro-batches" in result.stderr
    records = read_metrics(tmp_path)
    assert [s for s, _ in curve(records, "loss")] == list(range(1, 7)) and len(curve(records, "eval_loss")) == 3
    assert all(r["grad_norm"] > 0 for r in records if "loss" in r)
    # the lr DeepSpeed's pipeline engine trained each step at is docs/configuration.md's formula
    o = compose([])[0].optim  # conf/optim/adamw.yaml's values
    assert [r["lr"] for r in records if "loss" in r] == pytest.approx(
        [documented_lr(o.lr, o.min_lr, o.warmup_steps, 6, o.lr_decay, applied) for applied in range(6)])
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step6"


def test_training_without_a_validation_split(tmp_path):
    """data.valid_fraction=0 with evaluation off is a legal config: it must train, not crash."""
    result = run_cli([*TINY, "data.valid_fraction=0", "train.eval_interval=0", "train.max_steps=3",
                      f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    assert "valid samples=0" in result.stdout
    assert [s for s, _ in curve(read_metrics(tmp_path), "loss")] == [1, 2, 3]


def test_an_evaluation_larger_than_the_validation_set_is_warned_about_once(tmp_path):
    """train.eval_steps x global batch beyond the validation set wraps and counts samples twice: one
    line before training says so and names the largest eval_steps that does not; none when it fits."""
    import re

    args = [*TINY, "data.valid_fraction=0.005", "train.max_steps=1", "train.eval_interval=1"]
    result = run_cli([*args, "train.eval_steps=60", f"hydra.run.dir={tmp_path / 'wraps'}"])
    assert_ok(result)
    valid = int(re.search(r"valid samples=(\d+)", result.stdout)[1])
    assert 8 <= valid < 480, result.stdout  # TINY's global batch is 8: 60 of them wrap
    warnings = [line for line in result.stdout.splitlines() if "evaluation wraps" in line]
    assert warnings == [f"megaframe: warning: train.eval_steps=60 evaluates 60 x 8 = 480 samples but the validation "
                        f"set holds {valid}: evaluation wraps and counts {480 - valid} of them twice; set "
                        f"train.eval_steps<={valid // 8}"], result.stdout
    result = run_cli([*args, f"train.eval_steps={valid // 8}", f"hydra.run.dir={tmp_path / 'fits'}"])
    assert_ok(result)
    assert "evaluation wraps" not in result.stdout + result.stderr


def test_a_validation_file_of_its_own(tmp_path):
    """data.valid_path beside data.path, as nanoGPT's train.bin and val.bin: the training file trains
    whole, every window of the validation file is evaluated, and nothing is held out of either."""
    import numpy as np

    from megaframe.data import open_dataset

    prefixes = {}
    for name, count in (("train", 60), ("val", 12)):
        corpus = tmp_path / f"{name}.jsonl"
        corpus.write_text("".join(json.dumps({"text": f"{name} {i}: " + "a lazy dog sleeps. " * 30}) + "\n"
                                  for i in range(count)))
        prefixes[name] = tmp_path / "data" / name
        assert_ok(subprocess.run([console_script("megaframe-preprocess"), "--input", str(corpus),
                                  "--output-prefix", str(prefixes[name])], cwd=REPO, capture_output=True, text=True,
                                 timeout=120))
    windows = {name: (len(np.asarray(open_dataset(str(prefix), "byte").tokens)) - 1) // 32
               for name, prefix in prefixes.items()}  # TINY's seq_length: 32
    run_dir = tmp_path / "run"
    result = run_cli([*TINY, "train.max_steps=3", f"data.path={prefixes['train']}",
                      f"data.valid_path={prefixes['val']}", f"train.eval_steps={windows['val'] // 8}",
                      f"hydra.run.dir={run_dir}"])
    assert_ok(result)
    assert f"train samples={windows['train']} valid samples={windows['val']}" in result.stdout, result.stdout
    assert curve(read_metrics(run_dir), "eval_loss")
    # a missing validation file is one line before launch
    result = run_cli([*TINY, f"data.path={prefixes['train']}", f"data.valid_path={tmp_path / 'nope'}"])
    assert result.returncode == 2 and "data.valid_path=" in result.stderr and "Traceback" not in result.stderr


_COUNT_COMPOSITIONS = """
import sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl

calls = []
load = ConfigLoaderImpl.load_configuration


def counted(self, *args, **kwargs):
    calls.append(1)
    return load(self, *args, **kwargs)


ConfigLoaderImpl.load_configuration = counted
from megaframe.launch.main import train_main

try:
    train_main(sys.argv[1:])
finally:
    print(f"compositions: {len(calls)}", file=sys.stderr)
"""


def test_a_one_process_run_composes_its_config_once(tmp_path):
    """Hydra's composition is about 0.2 s of a start (issue 35): the pre-launch check composes and
    the run uses that composition; .hydra/ holds what Hydra's own run writes there."""
    import yaml

    args = [*TINY, "train.max_steps=2"]
    result = run_code(_COUNT_COMPOSITIONS, [*args, f"hydra.run.dir={tmp_path}"], timeout=300)
    assert_ok(result)
    assert "compositions: 1" in result.stderr, result.stderr[-2000:]
    hydra = yaml.safe_load((tmp_path / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert (hydra["job"]["name"], hydra["mode"], hydra["run"]["dir"]) == ("cli", "RUN", str(tmp_path))
    assert hydra["overrides"]["hydra"] == [f"hydra.run.dir={tmp_path}", "hydra.mode=RUN"]
    assert yaml.safe_load((tmp_path / ".hydra" / "overrides.yaml").read_text()) == args
    assert (tmp_path / "cli.log").exists() and read_metrics(tmp_path)[-1]["step"] == 2


_TASK_RAISES = """
import sys
import megaframe.training.trainer as trainer


def internal_error(*args, **kwargs):
    raise RuntimeError("an internal error before training")


trainer.train = internal_error
from megaframe.launch.main import train_main

train_main(sys.argv[1:])
"""


def test_an_error_in_the_composed_run_is_reported_as_hydras_run_reports_it(tmp_path):
    """The one-composition path runs the task inside Hydra's run_and_report, as hydra.main does:
    an exception the trainer does not classify is Hydra's short report and exit 1, not a raw traceback
    from outside it."""
    result = run_code(_TASK_RAISES, [*TINY, f"hydra.run.dir={tmp_path}"], timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "RuntimeError: an internal error before training" in result.stderr
    assert "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace." in result.stderr


def test_an_option_of_ones_own_config_dir_trains_on_two_ranks_and_plans(tmp_path, capsys, monkeypatch):
    """docs/configuration.md's own option (`--config-dir myconf model=gpt_small`) at dp=2: the run
    launches its two ranks (as a Hydra flag it went through hydra.main, which launches none: "needs 2
    ranks but the process group has 1"), and megaframe-plan reads the same option."""
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    (tmp_path / "myconf" / "model" / "gpt_small.yaml").write_text(
        "arch: gpt2\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 256\nseq_length: 64\n")
    result = run_cli(["--config-dir", str(tmp_path / "myconf"), "model=gpt_small", "parallel.dp=2",
                      "train.max_steps=2", "train.eval_interval=2", "train.log_interval=1",
                      "logging.wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}"])
    assert_ok(result)
    assert "launching 2 ranks" in result.stdout
    assert [s for s, _ in curve(read_metrics(tmp_path / "run"), "loss")] == [1, 2]
    # megaframe-plan in this process (what `python -m megaframe.plan` runs): a new interpreter's imports cost 6 CPU-s
    from megaframe.plan.cli import main as plan_main

    monkeypatch.chdir(REPO)
    capsys.readouterr()
    plan_main(["-cd", str(tmp_path / "myconf"), "model=gpt_small", "parallel.global_batch_size=16", "--json"])
    assert json.loads(capsys.readouterr().out)["plan"]["tokens_per_step"] == 16 * 64  # the option's seq_length
    # Hydra's own flags after the overrides, as before the flag became an override
    shown = run_cli(["--config-dir", str(tmp_path / "myconf"), "model=gpt_small", "--cfg", "job"])
    assert_ok(shown)
    assert "seq_length: 64" in shown.stdout
    listed = run_cli(["--config-dir", str(tmp_path / "myconf"), "--help"])
    assert_ok(listed)
    assert "gpt_small" in listed.stdout
