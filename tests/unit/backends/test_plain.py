"""The one-process plain engine (backends/plain/) against DeepSpeed's engine at the same config: the
same bits in every logged number (loss, gradient norm, learning rate, eval loss), through gradient
accumulation, clipping, activation checkpointing, GQA, MoE with its router biases, a skipped
non-finite step and a spike the guard skips, and across resumes from each engine's checkpoint into
the other. Which runs it takes, and that such a run never imports DeepSpeed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.composed import composes_runs
from tests.support.helpers import TINY, cli_env, read_metrics
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks

STEPS = ["train.max_steps=8", "train.eval_interval=4"]
DEEPSPEED = ["backend.plain_one_process=false"]
KEYS = ("loss", "grad_norm", "lr", "eval_loss", "skipped_steps", "moe/aux_loss", "moe/max_load")
CASES = {
    "gpt2": ["model=gpt_tiny", "optim.grad_clip=0.5"],  # clipped every step
    "llama-recompute": ["model=llama_tiny", "parallel.activation_checkpointing=true"],
    "moe": ["model=moe_tiny"],
    "dropout": ["model=gpt_tiny", "model.dropout=0.1"],  # the same dropout draws: the RNG consumed alike
}


def _curves(run_dir: Path) -> list[tuple]:
    return [(r["step"], *(r.get(k) for k in KEYS)) for r in read_metrics(run_dir) if "loss" in r or "eval_loss" in r]


def _both(tmp_path: Path, overrides: list[str], env: dict[str, str] | None = None) -> tuple[list, list]:
    runs = [([*TINY, *STEPS, *overrides], str(tmp_path / "plain")),
            ([*TINY, *STEPS, *overrides, *DEEPSPEED], str(tmp_path / "deepspeed"))]
    run_ranks(_train_with_env, 1, tmp_path, runs=runs, env=env or {})
    return _curves(tmp_path / "plain"), _curves(tmp_path / "deepspeed")


@composes_runs
def _train_with_env(rank: int, world: int, runs, env: dict[str, str]) -> list[float]:
    import os

    os.environ.update(env)
    return train_runs(rank, world, runs)


@pytest.mark.parametrize("case", list(CASES))
def test_plain_engine_is_deepspeed_bit_for_bit(case, tmp_path):
    plain, deepspeed = _both(tmp_path, CASES[case])
    assert len(plain) >= 8 and plain == deepspeed
    if case == "moe":
        assert all(row[KEYS.index("moe/aux_loss") + 1] is not None for row in plain if row[1] is not None)


def test_a_skipped_step_is_skipped_alike(tmp_path):
    """Step 3's gradients NaN (the norm guard skips it: no update, the schedule held); step 5's loss a
    spike (train.spike: skipped before the update). Losses, lr and the skip count: the same bits."""
    # the spiked step's loss is about 1.1x its window's (5.46 against 5.02 and 4.91 with the tiled initial
    # values, 1.0997): 1.1 had depended on the draws, 1.05 leaves a margin; the skip counts below say that
    # no other step trips it
    spike = ["train.spike.metric=ratio", "train.spike.window=2", "train.spike.threshold=1.05"]
    plain, deepspeed = _both(tmp_path, spike, env={"MEGAFRAME_FAULTS": "nan_grad@3,spike@5"})
    skipped = KEYS.index("skipped_steps") + 1
    assert [row[skipped] for row in plain if row[0] in (2, 3, 5, 6) and row[1] is not None] == [0, 1, 2, 2]
    grad_norm = KEYS.index("grad_norm") + 1
    # on the spike's step DeepSpeed's norm is the poisoned one (NaN: how its engine is made to skip),
    # the plain engine's the real one; every other number is the same
    assert [row[:grad_norm] + row[grad_norm + 1:] for row in plain] == \
           [row[:grad_norm] + row[grad_norm + 1:] for row in deepspeed]
    assert [row for row in plain if row[0] != 5] == [row for row in deepspeed if row[0] != 5]


@pytest.mark.parametrize("writer", ["deepspeed", "plain"])
def test_each_engine_resumes_the_others_checkpoint(writer, tmp_path):
    """Saved at step 4 by one engine, resumed by the other: the uninterrupted run's numbers, bit for
    bit (weights, Adam's moments and step, the schedule, the RNG)."""
    base = [*TINY, *STEPS, "model=gpt_tiny", "model.dropout=0.1", "train.save_interval=4"]
    first = base + (DEEPSPEED if writer == "deepspeed" else [])
    second = base + ([] if writer == "deepspeed" else DEEPSPEED)
    saved = tmp_path / "first" / "checkpoints" / "global_step4"
    run_ranks(train_runs, 1, tmp_path, runs=[(first, str(tmp_path / "first")),
                                             ([*second, f"train.resume={saved}"], str(tmp_path / "resumed"))])
    resumed = _curves(tmp_path / "resumed")
    assert resumed[0][0] == 5 and resumed == [row for row in _curves(tmp_path / "first") if row[0] > 4]


def _runs_plain(overrides: list[str], world: int = 1) -> bool:
    from megaframe.backends.registry import runs_plain
    from megaframe.config.compose import compose

    cfg, _ = compose(overrides)
    return runs_plain(cfg, world)


def test_which_runs_go_plain(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert _runs_plain([]) and _runs_plain(["model=moe_tiny", "train.compile=true"])
    for deepspeeds_own in (["zero=stage1"], ["precision=bf16"], ["zero=stage2", "offload=cpu"],
                           ["train.native_checkpoint=true"], ["train.universal_checkpoint=false"],
                           ["backend.plain_one_process=false"], ["backend=fsdp2", "zero=stage2"]):
        assert not _runs_plain(deepspeeds_own), deepspeeds_own
    assert not _runs_plain([], world=2)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")  # an accelerator only DeepSpeed knows how to drive
    assert not _runs_plain([])
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert _runs_plain([])


PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("deepspeed imported:", "deepspeed" in sys.modules, "| collector on:", gc.isenabled(),
                              "| frozen:", gc.get_freeze_count() > 0, flush=True))
sys.argv = ["megaframe-train", *sys.argv[1:]]
from megaframe.train import main
main()
"""


def _probe(tmp_path: Path, *overrides: str) -> tuple[str, str]:
    """The probe's line and the run's start-up line."""
    done = subprocess.run([sys.executable, "-c", PROBE, *TINY, "train.max_steps=2", "logging.wandb.mode=disabled",
                           f"hydra.run.dir={tmp_path / 'run'}", *overrides],
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return lines[-1], next(line for line in lines if line.startswith("megaframe: gpt2"))


def test_a_one_process_run_never_imports_deepspeed_and_collects_again_after_start_up(tmp_path):
    """...and its start-up line says so: backend=deepspeed ran as plain torch, and the key that runs
    DeepSpeed's engine (which, asked for, runs and is named)."""
    probe, summary = _probe(tmp_path)
    assert probe == "deepspeed imported: False | collector on: True | frozen: True"
    assert "| backend=deepspeed as plain torch (" in summary and "backend.plain_one_process=false" in summary
    probe, summary = _probe(tmp_path / "ds", *DEEPSPEED)
    assert probe.startswith("deepspeed imported: True")
    assert "| backend=deepspeed zero=0 " in summary, summary


def test_a_checkpoint_of_deepspeeds_own_files_only_is_refused_naming_the_key(tmp_path):
    """Written by DeepSpeed's engine without layout-free tensors, resumed in one process at the
    defaults: one line naming backend.plain_one_process=false, the bad-checkpoint exit code."""
    from tests.support.helpers import run_cli

    from megaframe.common.failures import ExitCode

    saved_by = [*TINY, "train.max_steps=2", "train.save_interval=2", "train.universal_checkpoint=false"]
    first = run_cli([*saved_by, f"hydra.run.dir={tmp_path / 'first'}"])
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "first" / "checkpoints" / "global_step2"
    resumed = run_cli([*TINY, "train.max_steps=4", f"train.resume={saved}", "train.trust_pickled_checkpoint=true",
                       f"hydra.run.dir={tmp_path / 'resumed'}"])
    assert resumed.returncode == ExitCode.BAD_CHECKPOINT
    (line,) = [line for line in resumed.stderr.splitlines() if "backend.plain_one_process=false" in line]
    assert "holds only DeepSpeed's own files" in line and "Traceback" not in resumed.stderr
