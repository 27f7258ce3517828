"""bf16 at ZeRO-0 steps like bf16 at ZeRO-1 from its first update (megaframe/backends/deepspeed/build_step.py).

DeepSpeed's FP16_UnfusedOptimizer, which bf16 and fp16 get at ZeRO-0, steps AdamW once on zero
gradients when it is built: before the fix the first real update was 0.73x the learning rate (Adam's
bias correction counted from 2) and the run followed another curve, 1.2% off after four steps.

One process trains the tiny model four steps at ZeRO-0 and at ZeRO-1 (DeepSpeed's engine at one rank),
from the same initial weights, and compares:
  - Adam's step count after the first step (1, not 2) and the fp32 masters at build (exact copies of
    the module's weights: the build step's weight decay undone);
  - the first update of every fp32 master: the two stages' updates differ only by bf16 rounding of the
    gradients (measured 2026-11-28: median 0.0 of the update's size; 0.27 before the fix, the 0.73x);
  - the four-step loss curve, within 1e-3 relative (measured 3e-5; 1.1e-2 before the fix);
  - a native checkpoint resumed at ZeRO-0 keeps its Adam state (the undo runs at build only): the
    resumed run's step counts continue, and its curve is the uninterrupted one's.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.helpers import TINY, curve, read_metrics
from tests.support.parity import DEEPSPEED_AT_ONE_RANK
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
BASE = [*TINY, *DEEPSPEED_AT_ONE_RANK, "precision=bf16", "train.max_steps=4", "train.eval_interval=0"]


def _masters(backend) -> dict[str, torch.Tensor]:
    """Each trainable parameter's fp32 master, by name: ZeRO-0's FP16_UnfusedOptimizer keeps them in
    fp32_groups, ZeRO-1's reach them through DeepSpeed's fragment mapping."""
    from deepspeed.utils import safe_get_full_fp32_param

    names = {id(p): n for n, p in backend.module.named_parameters()}
    opt = backend.engine.optimizer
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        return {names[id(w)]: m.detach().clone() for ws, ms in zip(opt.fp16_groups, opt.fp32_groups)
                for w, m in zip(ws, ms)}
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in backend.module.named_parameters()
            if p.requires_grad}


def _adam_steps(backend) -> set[int]:
    return {int(s["step"]) for s in backend.engine.optimizer.optimizer.state.values()}


def _train(rank: int, world: int, root: str) -> dict:
    """Both stages' first updates and checks (the curves land in their run directories), then a
    ZeRO-0 run resumed from its step-2 native checkpoint."""
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    out: dict = {}
    for stage in (0, 1):
        save = ["train.save_interval=2", "train.universal_checkpoint=false"] if stage == 0 else []
        cfg, _ = compose([*BASE, f"zero=stage{stage}", *save])
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(root) / f"stage{stage}") as trainer:
            backend = trainer.backend
            before = _masters(backend)
            weights = {n: p.detach().float() for n, p in backend.module.named_parameters()}
            out[f"stage{stage}_masters_are_weights"] = all(torch.equal(before[n], weights[n]) for n in before)
            train_step, first = backend.train_step, {}

            def step_once(*args, **kwargs):
                result = train_step(*args, **kwargs)
                if not first:
                    first.update(update={n: m - before[n] for n, m in _masters(backend).items()},
                                 steps=_adam_steps(backend) if stage == 0 else None)
                return result
            backend.train_step = step_once
            trainer.fit()
            out[f"stage{stage}"] = first
    cfg, _ = compose([*BASE, "zero=stage0", "train.trust_pickled_checkpoint=true",
                      f"train.resume={Path(root) / 'stage0' / 'checkpoints' / 'global_step2'}"])
    with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(root) / "resumed") as trainer:
        trainer.fit()
        out["resumed_steps"] = _adam_steps(trainer.backend)
    return out


def test_bf16_at_zero0_takes_the_first_adam_step_of_zero1_and_follows_its_curve(tmp_path):
    got = run_ranks(_train, 1, tmp_path, root=str(tmp_path))[0]
    assert got["stage0_masters_are_weights"] and got["stage1_masters_are_weights"]
    assert got["stage0"]["steps"] == {1}, "Adam's step count after the first step (2: DeepSpeed's build step)"
    zero0, zero1 = got["stage0"]["update"], got["stage1"]["update"]
    assert zero0.keys() == zero1.keys()
    for name, want in zero1.items():
        if want.abs().max() == 0:
            continue
        gap = (zero0[name] - want).abs().median() / want.abs().median()
        assert gap < 0.05, f"{name}: first update differs from ZeRO-1's by {gap:.3f} of its size"
    c0, c1 = (curve(read_metrics(tmp_path / d), "loss") for d in ("stage0", "stage1"))
    assert [s for s, _ in c0] == [s for s, _ in c1] == [1, 2, 3, 4]
    worst = max(abs(a - b) / b for (_, a), (_, b) in zip(c0, c1))
    print(f"bf16 ZeRO-0 vs ZeRO-1, worst relative loss gap over 4 steps: {worst:.2e}")
    assert worst < 1e-3
    assert got["resumed_steps"] == {4}, "the resumed run's Adam state was not the checkpoint's"
    resumed = curve(read_metrics(tmp_path / "resumed"), "loss")
    assert resumed == c0[2:]
