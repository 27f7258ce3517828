"""Non-finite steps are skipped before the update, on every rank together, in every layout.

A NaN is injected into one parameter's gradient on one rank only (MEGAFRAME_FAULTS, training/faults.py)
at step 5. Every rank must skip that step: its master weights and Adam moments (the local ZeRO
partition where there is one) bitwise unchanged across it, the learning rate held, the step
counted in skipped_steps; the next step must update again. Layouts: dp=2 ZeRO-2, tp=2 (ZeRO-0,
where megaframe's own gate decides), pp=2 ZeRO-1, dp=2 ZeRO-3 with CPU offload, tp=2 with sequence
parallelism at ZeRO-1 in bf16, dp=2 ZeRO-0 in bf16 (DeepSpeed's BF16_Optimizer), and FSDP2 at dp=2.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
NAN_STEP = 5
BASE = [*TINY, "train.max_steps=7", "train.eval_interval=0"]
LAYOUTS = {
    "dp2-zero2": ["parallel.dp=2", "zero=stage2"],
    "tp2-zero0": ["parallel.tp=2"],
    "pp2-zero1": ["parallel.pp=2", "zero=stage1"],
    "dp2-zero3-cpu-offload": ["parallel.dp=2", "zero=stage3", "offload=cpu", "offload.param=cpu"],
    "tp2-sp-zero1-bf16": ["parallel.tp=2", "parallel.sequence_parallel=true", "zero=stage1", "precision=bf16"],
    "dp2-zero0-bf16": ["parallel.dp=2", "precision=bf16"],  # DeepSpeed's BF16_Optimizer
    "fsdp2-dp2-zero3": ["backend=fsdp2", "parallel.dp=2", "zero=stage3"],  # megaframe's own step
}


def _local_state(trainer) -> list:
    """This rank's master weights and Adam moments, copied: what the torch optimizer inside the engine
    steps (the flat fp32 ZeRO-1/2 partitions; the model's own parameters at ZeRO-0), or at ZeRO-3
    each parameter's local partition."""
    import torch

    state = []
    if trainer.cfg.backend.name == "fsdp2":  # torch's AdamW on this rank's local shards
        optimizer = trainer.backend.optimizer
        for param in trainer.backend.module.parameters():
            moments = optimizer.state.get(param, {})
            for tensor in (param, moments.get("exp_avg"), moments.get("exp_avg_sq")):
                state.append(None if tensor is None else tensor.detach().to_local().to("cpu", torch.float32, copy=True))
        return state
    engine = trainer.backend.engine
    if trainer.cfg.zero.stage == 3:  # partitions live in sub-groups DeepSpeed may swap: ask per parameter
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        def moment(param, key):
            try:
                return safe_get_local_optimizer_state(param, key)
            except KeyError:  # before the first step
                return None

        for param in engine.module.parameters():
            for tensor in (safe_get_local_fp32_param(param), moment(param, "exp_avg"), moment(param, "exp_avg_sq")):
                state.append(None if tensor is None else tensor.detach().to("cpu", torch.float32, copy=True))
        assert any(t is not None and t.numel() for t in state), "no local state found to compare"
        return state
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed's ZeRO wrapper, or plain
    for group in optimizer.param_groups:
        for param in group["params"]:
            moments = optimizer.state.get(param, {})
            for tensor in (param.data, moments.get("exp_avg"), moments.get("exp_avg_sq")):
                state.append(None if tensor is None else tensor.detach().to("cpu", torch.float32, copy=True))
    assert any(t is not None and t.numel() for t in state), "no local state found to compare"
    return state


def _same(a: list, b: list) -> bool:
    import torch

    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _train_with_faults(rank: int, world: int, overrides: list[str], run_dir: str, faults: str) -> dict:
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    os.environ["MEGAFRAME_FAULTS"] = faults
    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    snapshots, applied, lrs = {}, {}, {}
    take_step = trainer.train_step

    def recording_step():
        snapshots[trainer.step] = _local_state(trainer)
        result, lr = take_step()
        applied[trainer.step], lrs[trainer.step] = result.applied, lr
        return result, lr
    trainer.train_step = recording_step
    with trainer:
        trainer.fit()
    snapshots[trainer.step] = _local_state(trainer)
    return {"applied": applied, "lrs": lrs,
            "unchanged": {s: _same(snapshots[s - 1], snapshots[s]) for s in range(1, trainer.step + 1)}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nan_gradient_on_one_rank_skips_the_step_on_every_rank(layout, tmp_path, deepspeed_ops):
    deepspeed_ops([*BASE, *LAYOUTS[layout]])
    run_dir = tmp_path / "run"
    results = run_ranks(_train_with_faults, 2, tmp_path, overrides=[*BASE, *LAYOUTS[layout]], run_dir=str(run_dir),
                        faults=f"nan_grad@{NAN_STEP}:1")
    for rank, result in enumerate(results):
        assert [s for s, ok in result["applied"].items() if not ok] == [NAN_STEP], (rank, result["applied"])
        # the skipped step leaves weights and moments bitwise alone; every other step changes them
        assert [s for s, same in result["unchanged"].items() if same] == [NAN_STEP], (rank, result["unchanged"])
        # the LR schedule holds across the skip: step 6 trains at the lr step 5 would have used
        assert result["lrs"][NAN_STEP + 1] == result["lrs"][NAN_STEP], (rank, result["lrs"])
    records = read_metrics(run_dir)
    events = [r for r in records if "event" in r]
    assert [(r["step"], r["event"]) for r in events] == [(NAN_STEP, "non_finite_skipped")], events
    skipped = {r["step"]: r["skipped_steps"] for r in records if "loss" in r}
    assert [skipped[s] for s in range(1, 8)] == [0, 0, 0, 0, 1, 1, 1]


SPIKE_STEP = 8
# after 7 steps the loss falls steadily; every target of step 8 set to byte 0 lifts it ~5 standard
# deviations above the last 5 steps (measured: 6.13 against a mean of 4.67 and std 0.28 at tp=pp=dp=1)
SPIKE = ["train.max_steps=9", "train.spike.window=5", "train.spike.threshold=3"]


# the loss read in DeepSpeed's step loop / in its pipeline's loss_fn / in FSDP2's step
@pytest.mark.parametrize("layout", ["dp2-zero2", "pp2-zero1", "fsdp2-dp2-zero3"])
def test_loss_spike_is_skipped_before_the_update_on_every_rank(layout, tmp_path):
    run_dir = tmp_path / "run"
    results = run_ranks(_train_with_faults, 2, tmp_path, overrides=[*BASE, *LAYOUTS[layout], *SPIKE],
                        run_dir=str(run_dir), faults=f"spike@{SPIKE_STEP}")
    for rank, result in enumerate(results):
        assert [s for s, ok in result["applied"].items() if not ok] == [SPIKE_STEP], (rank, result["applied"])
        assert [s for s, same in result["unchanged"].items() if same] == [SPIKE_STEP], (rank, result["unchanged"])
    (event,) = [r for r in read_metrics(run_dir) if "event" in r]
    assert (event["step"], event["event"]) == (SPIKE_STEP, "spike_skipped") and event["spike_metric"] > 3, event


def _scaler_around_a_spike(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    """The fp16 loss scaler's state after every step, on a pretended fp16 device."""
    from megaframe.backends.deepspeed.state_io import loss_scaler_state
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer
    from tests.support.parity import pretend_fp16_device

    pretend_fp16_device()
    os.environ["MEGAFRAME_FAULTS"] = f"spike@{SPIKE_STEP}"
    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    scaler, applied, take_step = {}, {}, trainer.train_step

    def recording_step():
        result, lr = take_step()
        scaler[trainer.step] = loss_scaler_state(trainer.backend.engine.optimizer)
        applied[trainer.step] = result.applied
        return result, lr
    trainer.train_step = recording_step
    with trainer:
        trainer.fit()
    return {"scaler": scaler, "applied": applied}


def test_a_spike_skip_at_the_minimum_fp16_scale_is_a_skip_not_the_end_of_the_run(tmp_path):
    """At the minimum scale, with no hysteresis left, DeepSpeed raised "Current loss scale already at
    minimum ... Exiting run." on the guard's own NaN: the spike ended the run. Now it is skipped."""
    fp16 = ["precision=fp16", "precision.initial_scale_power=0", "precision.min_loss_scale=1", "precision.hysteresis=1"]
    results = run_ranks(_scaler_around_a_spike, 2, tmp_path, overrides=[*BASE, *LAYOUTS["dp2-zero2"], *SPIKE, *fp16],
                        run_dir=str(tmp_path / "run"))
    for rank, result in enumerate(results):
        assert [s for s, ok in result["applied"].items() if not ok] == [SPIKE_STEP], (rank, result["applied"])
        assert sorted(result["applied"]) == list(range(1, 10)), rank  # the run went on to its last step
        assert result["scaler"][SPIKE_STEP]["cur_scale"] == 1.0, rank


@pytest.mark.parametrize("layout", ["dp2-zero2", "pp2-zero1"])
def test_a_spike_skip_at_fp16_leaves_the_loss_scale_as_it_was(layout, tmp_path):
    """The guard's skip poisons the gradients with NaN, which DeepSpeed's dynamic scaler took for an
    overflow: every spike skipped used up the scaler's hysteresis and then halved the scale, as a
    real overflow does. Now the scaler is as it was before the skipped step. A scale of 2^8 so that
    no step overflows for real; hysteresis 1 so that a counted overflow halves the scale at once."""
    fp16 = ["precision=fp16", "precision.initial_scale_power=8", "precision.hysteresis=1"]
    results = run_ranks(_scaler_around_a_spike, 2, tmp_path, overrides=[*BASE, *LAYOUTS[layout], *SPIKE, *fp16],
                        run_dir=str(tmp_path / "run"))
    for rank, result in enumerate(results):
        assert [s for s, ok in result["applied"].items() if not ok] == [SPIKE_STEP], (rank, result["applied"])
        before, after = result["scaler"][SPIKE_STEP - 1], result["scaler"][SPIKE_STEP]
        assert before["cur_scale"] == 256.0 and after == before, (rank, before, after)


def _overflowing_at_the_minimum_scale(rank: int, world: int, overrides: list[str], run_dir: str) -> tuple:
    from megaframe.common.failures import Diverged
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer
    from tests.support.parity import pretend_fp16_device

    pretend_fp16_device()
    os.environ["MEGAFRAME_FAULTS"] = ",".join(f"nan_grad@{step}:0" for step in range(3, 9))
    cfg, _ = compose(overrides)
    try:
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
            trainer.fit()
    except Diverged as err:
        return "diverged", trainer.step, str(err)
    return "finished", trainer.step, ""


def test_a_run_that_keeps_overflowing_at_the_minimum_fp16_scale_stops_after_the_allowed_skips(tmp_path):
    """DeepSpeed no longer ends the run at the minimum scale itself (raise_error_at_min_scale off):
    the guard does, after train.max_consecutive_skips overflowing steps, each counted because the
    scale cannot shrink any more (docs/failures.md)."""
    fp16 = ["precision=fp16", "precision.initial_scale_power=0", "precision.min_loss_scale=1", "precision.hysteresis=1",
            "train.max_consecutive_skips=3"]
    results = run_ranks(_overflowing_at_the_minimum_scale, 2, tmp_path, overrides=[*BASE, *LAYOUTS["dp2-zero2"], *fp16],
                        run_dir=str(tmp_path / "run"))
    for kind, step, message in results:
        assert (kind, step) == ("diverged", 5) and "3 steps in a row skipped" in message, (kind, step, message)
