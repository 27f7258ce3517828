"""Resume into any layout: a checkpoint saved at tp=2 x pp=2 x dp=2 (ZeRO-1) after 10 steps resumes
at tp=1, at tp=4 x dp=2 and at pp=4 (x dp=2), and one saved at ZeRO-2 (tp=4 x dp=2) resumes at
ZeRO-3 (tp=2 x dp=4), one saved at ZeRO-2 dp=2 resumes at ZeRO-3 dp=4, and one saved at ZeRO-3 dp=4
resumes at tp=2 x pp=2 ZeRO-1; the next 10 losses, gradient norms and eval losses equal the uninterrupted
run's within rtol 1e-5 (fp32, real gloo ranks). A model-only checkpoint (no optimizer, step 0)
starts a run from those weights."""
from __future__ import annotations

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.support.parity import RTOL, assert_parity, train_runs
from tests.support.ranks import run_ranks

from megaframe.checkpoint import sharded, universal

pytestmark = pytest.mark.slow

# 4 layers so that pp=4 has a block per stage; one model for the whole chain
MODEL = [*TINY, "model.num_layers=4", "train.max_steps=20", "train.eval_interval=5"]
SAVED_AT = 10


def _resumed(records: list[dict]) -> list[dict]:
    return [r for r in records if r["step"] > SAVED_AT]


def test_resume_into_other_layouts(tmp_path):
    runs = {name: tmp_path / name for name in
            ("tp2pp2dp2", "tp4dp2_zero2", "to_tp4dp2", "to_pp4dp2", "to_tp2dp4_zero3", "reference", "to_tp1",
             "model_only", "dp2_zero2", "to_dp4_zero3", "dp4_zero3", "to_tp2pp2_zero1")}
    saved_3d = runs["tp2pp2dp2"] / "checkpoints"
    saved_zero2 = runs["tp4dp2_zero2"] / "checkpoints"
    first_legs = [
        ([*MODEL, "parallel.tp=2", "parallel.pp=2", "zero=stage1", f"train.exit_at_step={SAVED_AT}"], runs["tp2pp2dp2"]),
        ([*MODEL, "parallel.tp=4", "zero=stage2", f"train.exit_at_step={SAVED_AT}"], runs["tp4dp2_zero2"]),
    ]
    second_legs = [
        ([*MODEL, "parallel.tp=4", "zero=stage1", f"train.resume={saved_3d}"], runs["to_tp4dp2"]),
        ([*MODEL, "parallel.pp=4", "zero=stage1", f"train.resume={saved_3d}"], runs["to_pp4dp2"]),
        ([*MODEL, "parallel.tp=2", "zero=stage3", f"train.resume={saved_zero2}"], runs["to_tp2dp4_zero3"]),
    ]
    run_ranks(train_runs, 8, tmp_path, runs=[(args, str(d)) for args, d in first_legs + second_legs])
    # the pure data-parallel case: ZeRO-2 on 2 ranks -> ZeRO-3 on 4
    run_ranks(train_runs, 2, tmp_path, runs=[([*MODEL, "zero=stage2", f"train.exit_at_step={SAVED_AT}"],
                                              str(runs["dp2_zero2"]))])
    run_ranks(train_runs, 4, tmp_path, runs=[([*MODEL, "zero=stage3", f"train.resume={runs['dp2_zero2'] / 'checkpoints'}"],
                                              str(runs["to_dp4_zero3"])),
                                             ([*MODEL, "zero=stage3", f"train.exit_at_step={SAVED_AT}"], str(runs["dp4_zero3"]))])
    # ZeRO-3 partitions (flat ranges of whole tensors) into TP shards of pipeline stages
    run_ranks(train_runs, 4, tmp_path, runs=[([*MODEL, "parallel.tp=2", "parallel.pp=2", "zero=stage1",
                                               f"train.resume={runs['dp4_zero3'] / 'checkpoints'}"],
                                              str(runs["to_tp2pp2_zero1"]))])

    # a model-only checkpoint (what an HF import writes): the 3D run's weights at step 10, step 0
    state, model, _ = sharded.read_universal(saved_3d / f"global_step{SAVED_AT}")
    model_only = universal.write_universal(
        tmp_path / "model_only_ckpt", model,
        {"step": 0, "consumed_samples": 0, "model": state["model"]})
    single = [
        ([*MODEL], runs["reference"]),
        ([*MODEL, f"train.resume={saved_3d}"], runs["to_tp1"]),
        ([*MODEL, "train.max_steps=1", f"train.resume={model_only}"], runs["model_only"]),
    ]
    run_ranks(train_runs, 1, tmp_path, runs=[(args, str(d)) for args, d in single])

    reference = read_metrics(runs["reference"])
    # the 3D run wrote the tp=1 model's names and shapes (vocabulary unpadded), like the tp=1 run
    _, reference_model, reference_optim = sharded.read_universal(runs["reference"] / "checkpoints" / "global_step20")
    assert {k: v.shape for k, v in model.items()} == {k: v.shape for k, v in reference_model.items()}
    assert set(reference_optim) == {f"{key}.{name}" for key in universal.MOMENT_KEYS for name in reference_model}
    for name in ("to_tp1", "to_tp4dp2", "to_pp4dp2", "to_tp2dp4_zero3", "to_dp4_zero3", "to_tp2pp2_zero1"):
        got = read_metrics(runs[name])
        assert min(r["step"] for r in got) == SAVED_AT + 1, f"{name} did not resume at step {SAVED_AT}"
        assert_parity(got, _resumed(reference), f"{name} (resumed)")
    # every record says its world; a resume into another world size is an event at its first step
    to_dp4 = read_metrics(runs["to_dp4_zero3"])
    assert {(r["world_size"], r["dp"]) for r in to_dp4 if "loss" in r} == {(4, 4)}
    assert [r for r in to_dp4 if r.get("event") == "resized"] == [
        {"step": SAVED_AT + 1, "event": "resized", "world_size": 4, "dp": 4, "previous_world_size": 2, "previous_dp": 2}]
    assert not any(r.get("event") == "resized" for r in read_metrics(runs["to_tp4dp2"]))  # 8 ranks -> 8 ranks
    # the source runs themselves agree with the reference up to the save
    for name in ("tp2pp2dp2", "tp4dp2_zero2", "dp2_zero2", "dp4_zero3"):
        assert_parity(read_metrics(runs[name]), [r for r in reference if r["step"] <= SAVED_AT], name)

    # model-only: step 0 evaluates the step-10 weights; the optimizer and schedule start fresh
    fresh = read_metrics(runs["model_only"])
    eval_at_save = next(r["eval_loss"] for r in reference if r["step"] == SAVED_AT and "eval_loss" in r)
    eval_at_start = next(r["eval_loss"] for r in fresh if r["step"] == 0)
    assert eval_at_start == pytest.approx(eval_at_save, rel=RTOL)
    first_lr = next(r["lr"] for r in fresh if r["step"] == 1 and "lr" in r)
    assert first_lr == next(r["lr"] for r in reference if r["step"] == 1 and "lr" in r)  # warmup from the start
