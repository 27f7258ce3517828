"""Shared by the parity tests: train configs inside a set of ranks, compare curves."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import curve

FLAVOURS = {"gpt2": ["model=gpt_tiny"], "llama": ["model=llama_tiny"]}  # llama_tiny: 2 kv heads (GQA)
RTOL = 1e-5


def pretend_fp16_device() -> None:
    """Test-only: tell DeepSpeed's capability check that this CPU has fp16 (the arithmetic then runs on
    the CPU). validate()'s default fp16 rule asks the same accelerator, so it accepts fp16 too."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def train_runs(rank: int, world: int, runs: list[tuple[list[str], str]], fp16: bool = False) -> None:
    """Train each (overrides, run_dir) in turn inside these ranks (saves a process start per config);
    fp16=True runs them on a pretended fp16 device (pretend_fp16_device)."""
    from megaframe.cli import compose
    from megaframe.config.validate import validate
    from megaframe.engine.trainer import Trainer

    if fp16:
        pretend_fp16_device()
    for overrides, run_dir in runs:
        cfg, _ = compose(overrides)
        with Trainer(cfg, validate(cfg, world), Path(run_dir)) as trainer:  # validation asks the same check
            trainer.fit()


def assert_parity(got: list[dict], want: list[dict], what: str) -> None:
    """Every logged loss, gradient norm and eval loss within RTOL of the reference run's."""
    for key in ("loss", "grad_norm", "eval_loss"):
        g, w = curve(got, key), curve(want, key)
        assert [s for s, _ in g] == [s for s, _ in w] and len(w) >= 2, f"{what}: {key} steps differ"
        for (step, a), (_, b) in zip(g, w):
            assert a == pytest.approx(b, rel=RTOL), f"{what}: {key} at step {step}: {a} vs reference {b}"
