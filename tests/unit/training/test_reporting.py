"""The run's reports as callbacks (training/reporting.py): the hooks reach every callback in order,
the close in reverse, W&B's default run name spells the layout as the start-up line does, and an
fp8 run's step record has MFU against the bf16 peak with mfu_fp8 beside it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megaframe.backends import StepResult
from megaframe.config.compose import compose
from megaframe.model.factory import resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.tracking.flops import flops_per_token, fp8_flops_per_token
from megaframe.training.reporting import Callback, ClosingLine, Reporting, StepRecord, wandb_names
from megaframe.resume_hint import resume_command


def _trainer(tmp_path):
    cfg = SimpleNamespace(
        model=SimpleNamespace(arch="gpt2", seq_length=8),
        logging=SimpleNamespace(wandb=SimpleNamespace(group=None)),
        zero=SimpleNamespace(stage=1), precision=SimpleNamespace(dtype="bf16"))
    layout = SimpleNamespace(grid=ParallelDims(dp=2, ep=2))
    return SimpleNamespace(cfg=cfg, layout=layout, is_logger=True, run_dir=tmp_path)


def test_hooks_reach_the_callbacks_in_order_and_close_in_reverse(tmp_path, monkeypatch):
    calls = []

    def recorder(tag):
        class Recorder(Callback):
            def on_start(self):
                calls.append((tag, "start"))

            def on_step(self, result, lr, seconds):
                calls.append((tag, "step", result.loss, lr))

            def on_event(self, event):
                calls.append((tag, "event", event))

            def on_eval(self, loss):
                calls.append((tag, "eval", loss))

            def on_close(self, failed):
                calls.append((tag, "close", failed))
        return Recorder

    monkeypatch.setattr("megaframe.training.reporting.memory_plan", lambda cfg, layout: None)
    report = Reporting(_trainer(tmp_path), metrics=None, callbacks=[recorder("a"), recorder("b")])
    report.on_start()
    report.on_step(StepResult(loss=2.5, applied=True), 0.1, 1.0)
    report.on_event("skip")
    report.on_eval(3.0)
    report.on_close(True)
    assert calls == [("a", "start"), ("b", "start"), ("a", "step", 2.5, 0.1), ("b", "step", 2.5, 0.1),
                     ("a", "event", "skip"), ("b", "event", "skip"), ("a", "eval", 3.0), ("b", "eval", 3.0),
                     ("b", "close", True), ("a", "close", True)]


def test_the_wandb_name_holds_every_axis_in_use(tmp_path):
    """ep was missing from the W&B name: two runs that differ only in ep shared one name."""
    t = _trainer(tmp_path)
    assert wandb_names(t.cfg, t.layout, 12_400_000) == ("gpt2-12M-tp1pp1dp2ep2-zero1-bf16", "gpt2-12M")
    t.cfg.logging.wandb.group = "recipe"
    assert wandb_names(t.cfg, t.layout, 12_400_000)[0] == "recipe-tp1pp1dp2ep2-zero1-bf16"


def _step_record(*keys: str):
    """A step record of one step of a second on one H100 (a stand-in trainer: the record reads its
    config, model shape, layout and a few backend figures)."""
    cfg = compose(["cluster=h100_80g", *keys])[0]
    dims = resolve_dims(cfg.model, 96)
    trainer = SimpleNamespace(cfg=cfg, dims=dims, layout=SimpleNamespace(global_batch_size=8, world_size=1, dp=1),
                              backend=SimpleNamespace(device=torch.device("cuda"), grad_norm=lambda: 1.0,
                                                      precision_state=dict, router_metrics=dict),
                              step=1, consumed_samples=8, guard=SimpleNamespace(skipped_steps=0),
                              data=SimpleNamespace(blended=False))
    record = StepRecord(trainer, SimpleNamespace())
    record.steps, record.seconds = 1, 1.0
    return record.record(1.0, 1.0, 1e-3), flops_per_token(dims) * 8 * cfg.model.seq_length / 1e12, dims, cfg


def test_mfu_is_against_the_bf16_peak_with_the_fp8_figure_beside_it():
    row, tflops, dims, cfg = _step_record("precision=fp8")
    assert row["mfu"] == pytest.approx(tflops / 989)
    share = fp8_flops_per_token(dims, cfg.precision.fp8) / flops_per_token(dims)
    assert row["mfu_fp8"] == pytest.approx(tflops / (1 / ((1 - share) / 989 + share / 1979)))
    assert "mfu_fp8" not in _step_record("precision=bf16")[0]


def _closing(tmp_path, step: int, last_checkpoint):
    cfg = SimpleNamespace(train=SimpleNamespace(max_steps=20, exit_at_step=0), model=SimpleNamespace(seq_length=64),
                          data=SimpleNamespace(tokenizer="byte"))
    trainer = SimpleNamespace(cfg=cfg, step=step, stopped_by=None, fails_again=False, run_dir=tmp_path,
                              layout=SimpleNamespace(global_batch_size=16), last_checkpoint=last_checkpoint,
                              checkpoint_dir=tmp_path / "checkpoints", dims=SimpleNamespace(vocab_size=257))
    return trainer, ClosingLine(trainer, SimpleNamespace(is_logger=True, wandb=None))


def test_the_closing_line_counts_the_tokens_this_process_trained_in_its_time(tmp_path):
    """A run resumed at step 10 of 20 trained 10 x 16 x 64 tokens in its time: its closing line
    said the whole run's 20 steps' tokens next to this process's minutes."""
    trainer, closing = _closing(tmp_path, step=10, last_checkpoint=tmp_path / "global_step20")
    closing.on_start()
    trainer.step = 20
    assert closing.line(failed=False).split(" | ")[1] == "10.2k tokens in 0m00s (from step 10; 20.5k in all)"
    fresh, closing = _closing(tmp_path, step=0, last_checkpoint=tmp_path / "global_step20")
    closing.on_start()
    fresh.step = 20
    assert closing.line(failed=False).split(" | ")[1] == "20.5k tokens in 0m00s"
    refused, closing = _closing(tmp_path, step=10, last_checkpoint=None)  # refused before training
    assert closing.line(failed=True).split(" | ")[1] == "0 tokens in 0m00s (from step 10; 10.2k in all)"


def test_a_run_refused_before_training_names_no_checkpoint_as_its_last(tmp_path):
    """A resume refused (exit 5: a truncated shard, `latest` edited to ../..) said "last checkpoint
    none" beside three good ones, or named the checkpoint just refused (review). A failure a rerun
    would not repeat still names what `latest` does, with the command that resumes."""
    (tmp_path / "checkpoints" / "global_step30").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("global_step30\n")
    refused, closing = _closing(tmp_path, step=0, last_checkpoint=None)
    refused.fails_again = True
    assert closing.line(failed=True).split(" | ")[2] == "nothing resumed: see the error below"
    (tmp_path / "checkpoints" / "latest").write_text("../..\n")
    assert closing.line(failed=True).split(" | ")[2] == "nothing resumed: see the error below"
    (tmp_path / "checkpoints" / "latest").write_text("global_step30\n")
    refused.step = 30  # read, then refused (another global batch): it is whole, and named
    assert closing.line(failed=True).split(" | ")[2] == f"last checkpoint {tmp_path / 'checkpoints' / 'global_step30'}"
    refused.step, refused.fails_again = 0, False  # a node lost before the first step: the checkpoint stands
    assert closing.line(failed=True).split(" | ")[2:4] == [
        f"last checkpoint {tmp_path / 'checkpoints' / 'global_step30'}", f"resume: {resume_command(tmp_path)}"]
