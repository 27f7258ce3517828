"""bf16 and fp16 through the real DeepSpeed engine: 50-step loss curves track fp32, bf16 keeps fp32 master
weights and logs no loss-scaling fields, and an fp16 overflow is skipped, halves the scale and training
goes on.

This CPU has no fp16, so DeepSpeed refuses it (and so does our validation, see
tests/e2e/test_cli_errors.py); here the ranks pretend an fp16 device (parity.pretend_fp16_device)
and the fp16 arithmetic runs on the CPU. On a GPU the same tests run for real.

Tolerances (mean over the 50 logged steps of |loss - fp32 loss| / fp32 loss):
  bf16 1%:   8 mantissa bits (a rounding of 2^-9 = 0.2% per operation) in the forward pass and the
             gradients, fp32 master weights; measured 0.15% on this CPU (2026-11-22). 1% is ~7x that and
             still 30x below the curve's own fall (> 30% over these steps): a broken path cannot pass.
  fp16 0.3%: 11 mantissa bits (2^-12 = 0.025%), 8x finer than bf16; measured 0.033%, ~9x margin.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import TINY, curve, read_metrics
from tests.support.parity import pretend_fp16_device, train_runs
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=50", "train.eval_interval=25"]
BF16_TOL, FP16_TOL = 0.01, 0.003
OVERFLOW_STEP = 6  # the 7th optimizer step gets an inf gradient
FP16 = ["precision=fp16", "precision.initial_scale_power=8", "precision.hysteresis=1"]


def _mean_relative_gap(got: list[dict], want: list[dict]) -> float:
    g, w = curve(got, "loss"), curve(want, "loss")
    assert [s for s, _ in g] == [s for s, _ in w] and len(w) == 50
    return sum(abs(a - b) / b for (_, a), (_, b) in zip(g, w)) / len(w)


def _dtypes(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    """Train bf16 briefly; report the dtype of the module's weights and of the optimizer's master copy."""
    from deepspeed.utils import safe_get_full_fp32_param

    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    cfg, _ = compose(overrides)
    with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
        trainer.fit()
        weight = next(p for p in trainer.backend.module.parameters() if p.dim() == 2)
        return {"module": str(weight.dtype), "master": str(safe_get_full_fp32_param(weight).dtype)}


def test_bf16_and_fp16_track_fp32_and_bf16_keeps_fp32_masters(tmp_path):
    base = [*TINY, *STEPS, "zero=stage1"]
    runs = [([*base, f"precision={dtype}"], str(tmp_path / dtype)) for dtype in ("fp32", "bf16")]
    runs.append(([*base, *FP16], str(tmp_path / "fp16")))
    run_ranks(train_runs, 1, tmp_path, runs=runs, fp16=True)
    fp32, bf16, fp16 = (read_metrics(tmp_path / d) for d in ("fp32", "bf16", "fp16"))
    gaps = {"bf16": _mean_relative_gap(bf16, fp32), "fp16": _mean_relative_gap(fp16, fp32)}
    print(f"mean relative loss gap to fp32 over 50 steps: {gaps}")
    assert gaps["bf16"] < BF16_TOL and gaps["fp16"] < FP16_TOL, gaps
    losses = [v for _, v in curve(fp32, "loss")]
    assert losses[-1] < 0.7 * losses[0], "the reference curve must move far more than the tolerance"
    for records in (fp32, bf16):  # loss scaling exists only under fp16; no step was skipped
        assert not any("loss_scale" in r for r in records)
        assert all(r["skipped_steps"] == 0 for r in curve_records(records))
    assert all(r["skipped_steps"] == 0 and r["loss_scale"] == 2.0**8 for r in curve_records(fp16))
    dtypes = run_ranks(_dtypes, 1, tmp_path, overrides=[*base, "precision=bf16", "train.max_steps=2"],
                       run_dir=str(tmp_path / "bf16-dtypes"))[0]
    assert dtypes == {"module": "torch.bfloat16", "master": "torch.float32"}


def curve_records(records: list[dict]) -> list[dict]:
    """The training records (not the eval lines)."""
    return [r for r in records if "loss" in r]


def _overflow_at_one_step(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    """Train fp16 with an inf gradient injected into step OVERFLOW_STEP; snapshot the weights around it."""
    import torch

    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    pretend_fp16_device()
    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    weights = [p for p in trainer.backend.module.parameters() if p.requires_grad]
    weights[0].register_hook(lambda g: g * float("inf") if trainer.step == OVERFLOW_STEP else g)
    snapshots, train_step = {}, trainer.train_step

    def snapshotting_step():
        if trainer.step in (OVERFLOW_STEP, OVERFLOW_STEP + 1, OVERFLOW_STEP + 2):
            snapshots[trainer.step] = [w.detach().float().clone() for w in weights]
        return train_step()
    trainer.train_step = snapshotting_step
    with trainer:
        trainer.fit()

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return {"skipped_step_unchanged": same(snapshots[OVERFLOW_STEP], snapshots[OVERFLOW_STEP + 1]),
            "next_step_changed": not same(snapshots[OVERFLOW_STEP + 1], snapshots[OVERFLOW_STEP + 2])}


@pytest.mark.parametrize("stage", [0, 2])  # FP16_Optimizer and the ZeRO optimizer keep the scale differently
def test_fp16_overflow_skips_the_step_halves_the_scale_and_training_goes_on(stage, tmp_path):
    overrides = [*TINY, *FP16, "train.max_steps=20", "train.eval_interval=0", f"zero=stage{stage}"]
    result = run_ranks(_overflow_at_one_step, 1, tmp_path, overrides=overrides, run_dir=str(tmp_path / "run"))[0]
    assert result == {"skipped_step_unchanged": True, "next_step_changed": True}
    records = {r["step"]: r for r in curve_records(read_metrics(tmp_path / "run"))}
    bad = OVERFLOW_STEP + 1  # records carry the step count after the step
    assert [records[s]["skipped_steps"] for s in (bad - 1, bad, bad + 1, 20)] == [0, 1, 1, 1]
    assert records[bad - 1]["loss_scale"] == 2.0**8 and records[bad]["loss_scale"] == 2.0**7
    assert records[20]["loss_scale"] == 2.0**7  # window 1000: no regrowth within 20 steps
    assert records[20]["loss"] < records[bad]["loss"], "training did not go on after the skipped step"


def test_fp16_resume_from_the_layout_free_checkpoint_grows_the_scale_when_the_whole_run_does(tmp_path, monkeypatch):
    """Checkpoints hold one copy (no DeepSpeed files) by default, so the fp16 loss scaler's counters
    travel in state.json: an overflow at step 3 halves the scale, window 4 grows it back at step 8 and
    again at 12; a run stopped at step 9 and resumed must grow it at step 12 too, with the same losses."""
    monkeypatch.setenv("MEGAFRAME_FAULTS", "nan_grad@3")  # read by every forked rank's Trainer
    base = [*TINY, *FP16, "zero=stage1", "precision.loss_scale_window=4", "train.max_steps=14",
            "train.eval_interval=0", "train.save_interval=3"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    runs = [(base, str(whole)), ([*base, "train.exit_at_step=9"], str(resumed)), (base, str(resumed))]
    run_ranks(train_runs, 1, tmp_path, runs=runs, fp16=True)
    assert not list((resumed / "checkpoints" / "global_step9").glob("*model_states.pt")), "DeepSpeed files by default"

    def scale_and_loss(run_dir):
        return [(r["step"], r["loss_scale"], r["loss"]) for r in curve_records(read_metrics(run_dir))]
    want = scale_and_loss(whole)
    scales = [scale for _, scale, _ in want]
    assert scales[2] == 2.0**7 and scales[7] == 2.0**8 and scales[11] == 2.0**9, scales  # the schedule tested
    assert scale_and_loss(resumed) == want
