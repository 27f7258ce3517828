"""What a run reports, as callbacks on the training loop (the shape of OLMo-core's trainer callbacks):
the start-up summary, W&B, the progress bar, the step record, the guard's events, evaluations, the
model-state line and the closing line, each a Callback the trainer calls through Reporting.

Rank 0 writes (metrics.jsonl, W&B, the console); every rank calls every hook, because some of
what a record holds is a collective (router metrics, the model-state gather). Adding a report is
adding a Callback to `default_callbacks`, with no edit to the loop.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Optional

import torch

from megaframe.backends import StepResult
from megaframe.backends.registry import engine_said
from megaframe.checkpoint.universal import CheckpointError
from megaframe.config.fp8_rules import eager_fp8_warning
from megaframe.data.dataset import eval_wrap_problem
from megaframe.parallel.fp8 import describe as fp8_said
from megaframe.plan.startup import (gather_model_states, memory_plan, model_states_line, model_states_record,
                                    plan_summary)
from megaframe.resume_hint import resume_command
from megaframe.tracking.flops import flops_per_token, fp8_aware_peak, peak_tflops
from megaframe.tracking.loss_report import eval_summary
from megaframe.tracking.metrics import MetricsLog, memory_gb, run_metadata
from megaframe.tracking.progress import Progress, wants_bar
from megaframe.tracking.wandb_run import WandbRun
from megaframe.checkpoint import store as checkpoint
from megaframe.training.stop_signal import StopSignal


class Outputs:
    """Where rank 0's reports go, shared by the callbacks: metrics.jsonl, the W&B run and the
    progress bar (the last two made by their callbacks at the start); and the memory plan that the
    start-up summary shows and the model-state line compares with."""

    def __init__(self, metrics: MetricsLog, is_logger: bool, plan):
        self.metrics, self.is_logger, self.plan = metrics, is_logger, plan
        self.wandb: Optional[WandbRun] = None
        self.progress: Optional[Progress] = None

    def log(self, record: dict[str, Any]) -> None:
        """One record to metrics.jsonl and W&B (rank 0; a no-op on the others)."""
        if not self.is_logger:
            return
        self.metrics.append(record)
        self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def say(self, line: str) -> None:
        """One console line, above the progress bar when there is one."""
        (self.progress.write if self.progress else print)(line)


class Callback:
    """One report. Every hook is a no-op until overridden; `trainer` is the run's Trainer, `out`
    the outputs the callbacks share. Hooks run on every rank, in list order (on_close in reverse)."""

    def __init__(self, trainer, out: Outputs):
        self.trainer, self.out = trainer, out

    def on_start(self) -> None:
        """After the resume, before the first step of this process."""

    def on_step(self, result: StepResult, lr: float, seconds: float) -> None:
        """After each optimizer step (trainer.step is the step just taken), with its lr and time."""

    def on_event(self, event) -> None:
        """A skipped or flagged step (step_guard.SkipEvent)."""

    def on_eval(self, loss: float) -> None:
        """After an evaluation at trainer.step (0: before training)."""

    def on_close(self, failed: bool) -> None:
        """The run ends (failed: by an error)."""


class Reporting:
    """The run's callbacks and their outputs; the trainer calls these hooks and nothing else of them."""

    def __init__(self, trainer, metrics: MetricsLog, callbacks: Optional[list[type[Callback]]] = None):
        self.out = Outputs(metrics, trainer.is_logger, memory_plan(trainer.cfg, trainer.layout))
        self.callbacks = [kind(trainer, self.out) for kind in (callbacks or default_callbacks())]

    def log(self, record: dict[str, Any]) -> None:
        self.out.log(record)

    def on_start(self) -> None:
        for callback in self.callbacks:
            callback.on_start()

    def on_step(self, result: StepResult, lr: float, seconds: float) -> None:
        for callback in self.callbacks:
            callback.on_step(result, lr, seconds)

    def on_event(self, event) -> None:
        for callback in self.callbacks:
            callback.on_event(event)

    def on_eval(self, loss: float) -> None:
        for callback in self.callbacks:
            callback.on_eval(loss)

    def on_close(self, failed: bool) -> None:
        for callback in reversed(self.callbacks):  # the bar closes before the last line, W&B after it
            callback.on_close(failed)


# ---- the start and the end -------------------------------------------------------------------
class StartupSummary(Callback):
    """Rank 0's start-up line (model, layout, engine settings, batch, data, device, run dir), the
    memory plan under it, and a warning when an evaluation would wrap around the validation set or
    fp8 kernels run eagerly."""

    def on_start(self) -> None:
        if not self.out.is_logger:
            return
        print(startup_summary(self.trainer, self.out.plan), flush=True)
        for problem in (eval_wrap_warning(self.trainer),
                        eager_fp8_warning(self.trainer.cfg, self.trainer.backend.device.type)):
            if problem:
                print(f"megaframe: warning: {problem}", flush=True)


class Wandb(Callback):
    """The W&B run (logging.wandb): started with the config and run metadata, finished at the close
    (a failed run marked so). The default name and group come from wandb_names."""

    def on_start(self) -> None:
        if not self.out.is_logger:
            return
        t = self.trainer
        config = {**dataclasses.asdict(t.cfg), "run": run_metadata(t.layout.world_size, t.layout.grid.describe("record"),
                                                                   t.backend.versions(), t.engine)}
        self.out.wandb = WandbRun(t.cfg.logging.wandb, t.run_dir, config, *wandb_names(t.cfg, t.layout,
                                                                                        t.backend.num_parameters))

    def on_close(self, failed: bool) -> None:
        if self.out.wandb:
            self.out.wandb.finish(exit_code=1 if failed else 0)


class ProgressBar(Callback):
    """Rank 0's progress bar (logging.progress_bar), from the step the run resumed at."""

    def on_start(self) -> None:
        if self.out.is_logger:
            self.out.progress = Progress(self.trainer.cfg.train.max_steps, self.trainer.step,
                                         enabled=wants_bar(self.trainer.cfg.logging.progress_bar))

    def on_close(self, failed: bool) -> None:
        if self.out.progress:
            self.out.progress.close()


class ClosingLine(Callback):
    """The run's last line: how it ended, where, the losses, tokens and time, what to pick up next."""

    def __init__(self, trainer, out: Outputs):
        super().__init__(trainer, out)
        self.started = time.monotonic()
        self.first_step: Optional[int] = None  # where this process began training (a resume's step)
        self.last_loss: Optional[float] = None
        self.last_eval_loss: Optional[float] = None  # of a step trained here (not the one before step 1)

    def on_start(self) -> None:
        self.first_step = self.trainer.step

    def on_step(self, result: StepResult, lr: float, seconds: float) -> None:
        self.last_loss = result.loss

    def on_eval(self, loss: float) -> None:
        if self.trainer.step > 0:
            self.last_eval_loss = loss

    def on_close(self, failed: bool) -> None:
        if self.out.is_logger:
            print(self.line(failed), flush=True)

    def line(self, failed: bool) -> str:
        t, cfg = self.trainer, self.trainer.cfg.train
        if failed:
            ended = "failed"
        elif t.stopped_by:
            ended = f"stopped by {StopSignal.name(t.stopped_by)}"
        elif t.step < cfg.max_steps:
            ended = f"stopped early (train.exit_at_step={cfg.exit_at_step})" if cfg.exit_at_step else "stopped"
        else:
            ended = "finished"
        parts = [f"megaframe: {ended} at step {t.step}/{cfg.max_steps}"]
        losses = [f"loss {value:.4f}" if abs(value) < 1e4 else f"loss {value:.4g}"
                  for value in (self.last_loss,) if value is not None]
        if self.last_eval_loss is not None:  # next to a uniform guess, and in bits: did the run learn?
            losses.append(eval_summary(self.last_eval_loss, t.dims.vocab_size, t.cfg.data.tokenizer))
        if losses:
            parts.append(" ".join(losses))
        # the tokens this process trained in its time; a resumed run's whole count beside them
        minutes, seconds = divmod(int(time.monotonic() - self.started), 60)
        first = t.step if self.first_step is None else self.first_step  # None: it failed before training
        tokens_per_step = t.layout.global_batch_size * t.cfg.model.seq_length
        trained = f"{_amount((t.step - first) * tokens_per_step)} tokens in {minutes}m{seconds:02d}s"
        parts.append(f"{trained} (from step {first}; {_amount(t.step * tokens_per_step)} in all)" if first else trained)
        if failed and self.first_step is None and t.fails_again and t.last_checkpoint is None and t.step == 0:
            # refused before any checkpoint was read (a corrupt one, an edited `latest`): what
            # `latest` names may be the one refused, and "none" beside good ones was wrong (review);
            # the error line below says which checkpoint and why. One read and then refused (another
            # global batch) set the step, and is still named: it is whole.
            parts.append("nothing resumed: see the error below")
            last = None
        else:
            try:
                last = t.last_checkpoint or checkpoint.find_latest(t.checkpoint_dir)
            except CheckpointError:  # an edited `latest`: the run's error line says so
                last = None
            parts.append(f"last checkpoint {last or 'none'}")
        if last is not None and ended != "finished" and not t.fails_again:
            parts.append(f"resume: {resume_command(t.run_dir)}")
        if self.out.wandb and (hint := self.out.wandb.sync_hint()):
            parts.append(f"W&B offline: {hint}")
        return " | ".join(parts)


def _amount(tokens: int) -> str:
    """1.02k, 41k, 3.2B: three significant figures."""
    return next(f"{tokens / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                if tokens >= scale or scale == 1)


# ---- during the run --------------------------------------------------------------------------
class GuardEvents(Callback):
    """A skipped or flagged step: metrics.jsonl, W&B and one console line (rank 0); a stop is said
    by the run's one-line error instead."""

    WHAT = {"non_finite": "non-finite gradients", "spike": "loss spike", "overflow": "fp16 overflow"}

    def on_event(self, event) -> None:
        if not self.out.is_logger:
            return
        guard = self.trainer.guard
        self.out.log(event.record(guard.skipped_steps))
        if event.action == "stopped":
            return
        self.out.say(f"step {event.step}: {event.action} ({self.WHAT[event.reason]}"
                     + (f", metric {event.metric:.3g}" if event.metric is not None else "")
                     + f"); {guard.consecutive_skips} in a row, {guard.skipped_steps} skipped in all")


class ModelStates(Callback):
    """Once per process, after its first step: every rank's held model states, to rank 0 (a
    collective), as one console line. metrics.jsonl gets them once per run (step 1), so a resumed
    run's records equal an uninterrupted one's; W&B's charts take scalars, not per-rank tables."""

    def __init__(self, trainer, out: Outputs):
        super().__init__(trainer, out)
        self.logged = False

    def on_step(self, result: StepResult, lr: float, seconds: float) -> None:
        if self.logged:
            return
        t = self.trainer
        per_rank = gather_model_states(t.backend.held_model_states())
        self.logged = True
        if self.out.is_logger:
            if t.step == 1:
                self.out.metrics.append({**model_states_record(t.step, per_rank, self.out.plan, t.layout.grid),
                                         "consumed_samples": t.consumed_samples})
            self.out.say(model_states_line(per_rank, self.out.plan))


class StepRecord(Callback):
    """Every train.log_interval steps and at the last one: a metrics.jsonl / W&B record of the step
    (loss, its mean over the interval, schedule, throughput, MFU, memory, precision and router
    metrics, consumed tokens per source) and the progress bar's update."""

    def __init__(self, trainer, out: Outputs):
        super().__init__(trainer, out)
        cfg = trainer.cfg
        self.flops_per_token = flops_per_token(trainer.dims)
        self.peak_tflops = peak_tflops(cfg.cluster.peak_tflops, cfg.precision.dtype, cfg.cluster.gpu)
        # precision=fp8: mfu stays against the bf16 peak (as Megatron and torchtitan report it);
        # mfu_fp8 beside it against the run's fp8/bf16 mix (docs/metrics.md)
        self.fp8_peak = fp8_aware_peak(self.peak_tflops, cfg.cluster, cfg.precision.fp8, trainer.dims,
                                       trainer.backend.device.type)
        self.tokens_per_step = trainer.layout.global_batch_size * cfg.model.seq_length
        self.losses: list[float] = []
        self.steps, self.seconds = 0, 0.0

    def on_step(self, result: StepResult, lr: float, seconds: float) -> None:
        t, cfg = self.trainer, self.trainer.cfg.train
        self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        if math.isfinite(result.loss):  # the curve shows what every step computed; a NaN would hide the rest
            self.losses.append(result.loss)
        if t.step % cfg.log_interval == 0 or t.step == (cfg.exit_at_step or cfg.max_steps):
            mean_loss = math.fsum(self.losses) / len(self.losses) if self.losses else float("nan")
            record = self.record(result.loss, mean_loss, lr)
            self.out.log(record)
            if self.out.progress:
                self.out.progress.update(t.step, record)
            self.losses, self.steps, self.seconds = [], 0, 0.0

    def record(self, loss: float, loss_avg: float, lr: float) -> dict[str, Any]:
        """One metrics.jsonl line: the step's loss, its mean over the log interval (loss_avg, the
        finite steps only), schedule, throughput, MFU (when the peak is known), memory."""
        t = self.trainer
        world = t.layout.world_size
        tokens_per_s = self.steps * self.tokens_per_step / self.seconds
        tflops = tokens_per_s * self.flops_per_token / world / 1e12  # model TFLOP/s per device
        record = {"step": t.step, "loss": loss, "loss_avg": loss_avg, "lr": lr,
                  "grad_norm": t.backend.grad_norm(),
                  "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / world,
                  "tflops": tflops, "consumed_samples": t.consumed_samples,
                  "consumed_tokens": t.step * self.tokens_per_step, "step_time_s": self.seconds / self.steps,
                  "memory_gb": memory_gb(), "world_size": world, "dp": t.layout.dp,
                  "time": time.time()}  # wall clock (Unix seconds), as W&B's _timestamp: curves against time
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        if self.fp8_peak:
            record["mfu_fp8"] = tflops / self.fp8_peak
        record.update(t.backend.precision_state())  # fp16: loss_scale
        record.update(t.backend.router_metrics())  # MoE: aux/z losses, expert load, dropped tokens (a collective)
        record["skipped_steps"] = t.guard.skipped_steps
        if t.data.blended:  # per source: where the blend's tokens came from so far
            for name, tokens in t.data.train.consumed_tokens(t.step, t.layout.global_batch_size).items():
                record[f"consumed_tokens/{name}"] = tokens
        return record


class EvalRecord(Callback):
    """An evaluation's record (metrics.jsonl, W&B) and, after a trained step, its console line."""

    def on_eval(self, loss: float) -> None:
        t = self.trainer
        self.out.log({"step": t.step, "eval_loss": loss, "consumed_samples": t.consumed_samples})
        if t.step > 0 and self.out.progress:
            self.out.progress.write(f"step {t.step}: eval_loss {loss:.4f}")


def default_callbacks() -> list[type[Callback]]:
    """A run's reports, in hook order: the summary before W&B starts, the bar after it; at the
    close (reversed) the bar closes, the closing line prints, then W&B finishes with its hint said."""
    return [StartupSummary, Wandb, ClosingLine, ProgressBar, GuardEvents, ModelStates, StepRecord, EvalRecord]


# ---- the words ------------------------------------------------------------------------------
def wandb_names(cfg, layout, num_parameters: int) -> tuple[str, str]:
    """Default W&B (name, group): the group is the recipe's (recipes set logging.wandb.group) or
    the model's arch and size, so one model's layouts sit together; the name adds the layout."""
    group = cfg.logging.wandb.group or f"{cfg.model.arch}-{num_parameters / 1e6:.0f}M"
    return f"{group}-{layout.grid.describe('name')}-zero{cfg.zero.stage}-{cfg.precision.dtype}", group


def startup_summary(t, plan) -> str:
    """The start-up line (t: the Trainer, its backend built) and the memory plan under it."""
    c, lay = t.cfg, t.layout
    compiled = ("model (one graph)" if c.train.compile_scope == "model" else f"blocks={t.backend.compiled_blocks}")
    return (f"megaframe: {c.model.arch} {t.backend.num_parameters / 1e6:.2f}M params "
            f"(layers={c.model.num_layers} hidden={c.model.hidden_size} heads={c.model.num_attention_heads} "
            f"vocab={t.dims.vocab_size}{_padding(t.dims)}{_moe(t.dims)}) | "
            f"layout {lay.grid.describe()}"
            f"{f' cp_impl={c.parallel.cp_impl}' if lay.cp > 1 else ''} | {engine_said(c, t.engine)} "
            f"zero={c.zero.stage} "
            f"offload={c.offload.optimizer}/{c.offload.param} precision={c.precision.dtype}"
            f"{fp8_said(c.precision.fp8, t.backend.device.type)}"
            f"{f' compiled {compiled}' if t.backend.compiled_blocks else ''} | "
            f"batch micro={lay.micro_batch_size} global={lay.global_batch_size} "
            f"accum={lay.grad_accum_steps} seq={c.model.seq_length} | "
            f"train samples={len(t.data.train)} valid samples={len(t.data.valid or ())} | "
            f"device {_device_name(t.backend.device)} | run dir {t.run_dir}"
            f"\n{plan_summary(plan)}")


def eval_wrap_warning(t) -> Optional[str]:
    """An evaluation larger than the validation set wraps around it (eval_batches) and counts
    its first samples twice: a loss that is not the set's mean, said once, before training."""
    train, valid = t.cfg.train, t.data.valid
    if not train.eval_interval or valid is None:
        return None
    return eval_wrap_problem(train.eval_steps, t.layout.global_batch_size, valid.samples_before_a_repeat())


def _padding(dims) -> str:
    padded = dims.padded_vocab_size
    return f" padded to {padded}" if padded != dims.vocab_size else ""


def _moe(dims) -> str:
    moe = dims.moe
    if moe is None:
        return ""
    dropping = "dropless" if moe.capacity_factor is None else f"capacity {moe.capacity_factor}"
    return (f" moe={dims.num_moe_blocks} blocks x {moe.num_experts} experts top-{moe.top_k} {dropping}"
            f"{f' +{moe.shared_experts} shared' if moe.shared_experts else ''}")


def _device_name(device: torch.device) -> str:
    """This rank's device, with the GPU's name: 'cuda:0 (NVIDIA H100 80GB HBM3)', or 'cpu'."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
