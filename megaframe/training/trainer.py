"""The training loop: data -> backend steps -> metrics -> evals -> checkpoints -> W&B.

The loop, evaluation and logging live here; checkpoints are the CheckpointManager's (checkpoint/
manager.py), handed the run's named parts; everything engine-specific goes through a Backend
(megaframe/backends/), so this module never imports DeepSpeed.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaframe.backends import StepResult
from megaframe.backends.registry import run_engine
from megaframe.checkpoint.universal import CheckpointError
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout
from megaframe.data import micro_batches, eval_batches
from megaframe.data.dataset import eval_wrap_problem
from megaframe.data.token_check import check_token_ids, dataset_token_ranges
from megaframe.checkpoint import store as checkpoint, tokenizer_check
from megaframe.checkpoint.manager import CheckpointManager
from megaframe.checkpoint.parts import Plain
from megaframe.checkpoint.run_parts import BlendCursor, DataOrder, RunRecord, TokenizerRecord, TrainState
from megaframe.training.data_setup import DataSplits, build_data
from megaframe.training.failure_report import report_failure
from megaframe.training.faults import Faults
from megaframe.training.schedule import lr_scheduler_factory
from megaframe.training.step_guard import StepGuard
from megaframe.training.stop_signal import StopSignal, exit_code as signal_exit_code
from megaframe import run_lock
from megaframe.startup import resume_collector
from megaframe.failures import Diverged, RankHung, RunDirInUse, SaveFailed
from megaframe.model.factory import resolve_dims
from megaframe.parallel.context import zigzag_positions
from megaframe.parallel.hang import describe_hang, is_collective_timeout
from megaframe.parallel.state import ParallelState
from megaframe.plan.startup import (gather_model_states, memory_plan, model_states_line, model_states_record,
                                    plan_summary)
from megaframe.resume_hint import resume_command
from megaframe.tracking.flops import flops_per_token, peak_tflops
from megaframe.tracking.loss_report import eval_summary
from megaframe.tracking.metrics import MetricsLog, memory_gb, run_metadata
from megaframe.tracking.progress import Progress, wants_bar
from megaframe.tracking.wandb_run import WandbRun


class Trainer:
    """Owns one run: the backend, the data, the loop and everything it writes to the run dir."""

    def __init__(self, cfg: TrainConfig, layout: Layout, run_dir: Path):
        self.cfg, self.layout, self.run_dir = cfg, layout, Path(run_dir)
        # first: a Ctrl-C while the model builds stops the run before step 1 instead of a traceback
        self.stop_signal = StopSignal(layout.world_size).install()
        self.stopped_by = 0  # the signal that ended the run at a step boundary
        plug = run_engine(cfg, layout.world_size)
        self.engine = plug.name  # deepspeed, fsdp2, or plain (one process, DeepSpeed not imported)
        with self.stop_signal.joining():  # a signal while peers are awaited ends this rank at once
            plug.init_distributed(cfg.train.collective_timeout_s, cfg.train.join_timeout_s)
        self.ps = ParallelState.build(layout.grid)
        self.is_logger = self.ps.rank == 0
        self._own_run_dir()  # before anything is written to it
        if self.is_logger:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data: DataSplits = build_data(cfg.data, cfg.model.seq_length)
        tokenizer = tokenizer_check.run_record(cfg.data)  # saved with checkpoints, checked on resume
        # context parallelism: the cp ranks of one dp rank read the same samples, each keeping only
        # its zig-zag shard of every sequence (cut by the data path, before tensors are made)
        self.token_positions = (zigzag_positions(cfg.model.seq_length, layout.cp, self.ps.cp_rank).numpy()
                                if layout.cp > 1 else None)
        self.dims = resolve_dims(cfg.model, self.data.vocab_size, tp=layout.tp, device_type=plug.device_type())
        torch.manual_seed(cfg.train.seed)  # dropout streams; weights come from init_parameters
        if cfg.precision.tf32:  # fp32 matmuls on TF32 tensor cores; false leaves torch's own setting
            torch.backends.cuda.matmul.allow_tf32 = True
        self.backend = plug.build(cfg, layout, self.ps, self.dims, lr_scheduler_factory(cfg.optim, cfg.train.max_steps))
        resume_collector()  # start-up ends with the engine built (megaframe/startup.py)
        self.num_parameters = self.backend.num_parameters
        self._check_token_ids()
        self.flops_per_token = flops_per_token(self.dims)
        self.peak_tflops = peak_tflops(cfg.cluster.peak_tflops, cfg.precision.dtype, cfg.cluster.gpu)
        self.tokens_per_step = layout.global_batch_size * cfg.model.seq_length
        self.memory_plan = memory_plan(cfg, layout)
        self._model_states_logged = False
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.wandb: Optional[WandbRun] = None
        self.progress: Optional[Progress] = None
        self.step = 0
        self.guard = StepGuard(cfg.train.spike, cfg.train.max_consecutive_skips)
        self.last_loss: Optional[float] = None  # for the closing summary
        self.last_eval_loss: Optional[float] = None
        self.started = time.monotonic()
        self.faults = Faults(self.ps.rank)
        t, gbs = cfg.train, layout.global_batch_size
        self.checkpoints = CheckpointManager(cfg, layout, self.run_dir, self.backend, self.dims, self.metrics,
                                             self.ps.rank, self.stop_signal.unguarded, self.faults.in_save_hook)
        register = self.checkpoints.register  # the run's state, by name (adding one is a line here, no format change)
        register(tokenizer_check.RECORD_KEY, TokenizerRecord(tokenizer, t.resume_accept_tokenizer_change))
        register("train", TrainState(lambda: self.step, gbs, t.on_batch_size_change), inline=True)
        register("data", order := DataOrder(cfg.model.seq_length, t.seed, self.data, t.resume_accept_data_change))
        register("blend_cursor", BlendCursor(self.data, order, lambda: self.step, gbs))
        register("guard", Plain(self.guard))
        register("run", RunRecord(cfg, layout))

    def _own_run_dir(self) -> None:
        """Rank 0 locks the run dir (run_lock.py) unless our launcher holds it for us; every rank
        learns the answer, so a second run on a busy run dir ends on all ranks with one line."""
        problem = None
        if self.is_logger and not run_lock.held_by_parent(self.run_dir):
            problem = run_lock.acquire(self.run_dir)
        if self.layout.world_size > 1:
            answer = [problem]
            dist.broadcast_object_list(answer, src=0)
            problem = answer[0]
        if problem is not None:
            raise RunDirInUse(problem)

    def _check_token_ids(self) -> None:
        """Every token id in [0, vocabulary) (data/token_check.py), before step 1 and on every rank,
        whatever the layout: the ranks scan 1/world of the tokens each and reduce the extremes in
        one collective, at every start (the content, never a cache keyed on file metadata)."""
        def reduce_max(local):
            extremes = torch.from_numpy(local).to(self.backend.device)
            if self.layout.world_size > 1:
                dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
            return extremes.cpu().numpy()
        datasets = self.data.datasets
        for dataset, found in zip(datasets, dataset_token_ranges(datasets, self.ps.rank, self.layout.world_size,
                                                                 reduce_max)):
            vocab_key = "model.vocab_size" if self.cfg.model.vocab_size is not None else dataset.vocab_source
            check_token_ids(dataset, found, self.dims.vocab_size, vocab_key)

    @property
    def consumed_samples(self) -> int:
        """Samples trained on so far (the data position is a pure function of the step)."""
        return self.step * self.layout.global_batch_size

    # ---- one optimizer step and one evaluation ------------------------------------------------
    def train_step(self) -> tuple[StepResult, float]:
        """Run the step's micro-batches and advance self.step; return the step's result and the lr
        it used. The guard is asked before the update whether a spiking loss skips it."""
        batches = micro_batches(self.data.train, self.step, self.layout.global_batch_size,
                                self.layout.micro_batch_size, self.ps.dp_rank, self.layout.dp,
                                self.cfg.train.seed, self.token_positions)
        batches = self.faults.batches(self.step + 1, batches)
        lr = self.backend.lr()
        injected = self.faults.before_step(self.step + 1, self.backend.module)
        try:
            result = self.backend.train_step(
                batches, skip_if=self.guard.skip_before_update if self.guard.gates_updates else None)
        finally:
            if injected is not None:
                injected.remove()
        self.step += 1
        return result, lr

    def evaluate(self) -> float:
        """Mean loss over train.eval_steps global batches of held-out samples (same in every layout)."""
        # eval_steps global batches, fed as micro-batches: the same samples in every layout
        batches = eval_batches(self.data.valid, self.cfg.train.eval_steps * self.layout.grad_accum_steps,
                               self.layout.micro_batch_size, self.ps.dp_rank, self.layout.dp, self.token_positions)
        with self.stop_signal.unguarded():  # a stop signal waits for the evaluation, however long
            return self.backend.eval_step(batches)

    @property
    def last_checkpoint(self) -> Optional[Path]:
        """The last checkpoint this process wrote (the closing line names it)."""
        return self.checkpoints.last

    def _log(self, record: dict) -> None:
        if not self.is_logger:
            return
        self.metrics.append(record)
        self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _train_record(self, loss: float, loss_avg: float, lr: float, steps: int, seconds: float) -> dict:
        """One metrics.jsonl line: the step's loss, its mean over the log interval (loss_avg, the
        finite steps only), schedule, throughput, MFU (when the peak is known), memory."""
        tokens_per_s = steps * self.tokens_per_step / seconds
        tflops = tokens_per_s * self.flops_per_token / self.layout.world_size / 1e12  # model TFLOP/s per device
        record = {"step": self.step, "loss": loss, "loss_avg": loss_avg, "lr": lr,
                  "grad_norm": self.backend.grad_norm(),
                  "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / self.layout.world_size,
                  "tflops": tflops, "consumed_samples": self.consumed_samples,
                  "consumed_tokens": self.step * self.tokens_per_step, "step_time_s": seconds / steps,
                  "memory_gb": memory_gb(), "world_size": self.layout.world_size, "dp": self.layout.dp,
                  "time": time.time()}  # wall clock (Unix seconds), as W&B's _timestamp: curves against time
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        record.update(self.backend.precision_state())  # fp16: loss_scale
        record.update(self.backend.router_metrics())  # MoE: aux/z losses, expert load, dropped tokens
        record["skipped_steps"] = self.guard.skipped_steps
        if self.data.blended:  # per source: where the blend's tokens came from so far
            for name, tokens in self.data.train.consumed_tokens(self.step, self.layout.global_batch_size).items():
                record[f"consumed_tokens/{name}"] = tokens
        return record

    def _loss_scale_can_shrink(self) -> bool:
        """fp16 only: whether the loss scale is still above its floor (a skip is then the scaler's search)."""
        scale = self.backend.precision_state().get("loss_scale")
        return scale is not None and scale > self.cfg.precision.min_loss_scale

    def _log_event(self, event) -> None:
        """A skipped or flagged step: metrics.jsonl, W&B and one console line (rank 0)."""
        if not self.is_logger:
            return
        self._log(event.record(self.guard.skipped_steps))
        what = {"non_finite": "non-finite gradients", "spike": "loss spike", "overflow": "fp16 overflow"}[event.reason]
        if event.action == "stopped":
            return  # the run's one-line error says it
        line = (f"step {event.step}: {event.action} ({what}"
                + (f", metric {event.metric:.3g}" if event.metric is not None else "")
                + f"); {self.guard.consecutive_skips} in a row, {self.guard.skipped_steps} skipped in all")
        (self.progress.write if self.progress else print)(line)

    def _wandb_names(self) -> tuple[str, str]:
        """Default W&B (name, group): the group is the recipe's (recipes set logging.wandb.group) or
        the model's arch and size, so one model's layouts sit together; the name adds the layout."""
        c = self.cfg
        group = c.logging.wandb.group or f"{c.model.arch}-{self.num_parameters / 1e6:.0f}M"
        cp = f"cp{self.layout.cp}" if self.layout.cp > 1 else ""
        name = (f"{group}-tp{self.layout.tp}pp{self.layout.pp}{cp}dp{self.layout.dp}-zero{c.zero.stage}"
                f"-{c.precision.dtype}")
        return name, group

    def _summary(self) -> str:
        c = self.cfg
        return (f"megaframe: {c.model.arch} {self.num_parameters / 1e6:.2f}M params "
                f"(layers={c.model.num_layers} hidden={c.model.hidden_size} heads={c.model.num_attention_heads} "
                f"vocab={self.dims.vocab_size}{self._padding_summary()}"
                f"{self._moe_summary()}) | "
                f"layout {self.layout.grid.describe()}"
                f"{f' cp_impl={c.parallel.cp_impl}' if self.layout.cp > 1 else ''} | zero={c.zero.stage} "
                f"offload={c.offload.optimizer}/{c.offload.param} precision={c.precision.dtype}"
                f"{f' compiled {self._compiled()}' if self.backend.compiled_blocks else ''} | "
                f"batch micro={self.layout.micro_batch_size} global={self.layout.global_batch_size} "
                f"accum={self.layout.grad_accum_steps} seq={c.model.seq_length} | "
                f"train samples={len(self.data.train)} valid samples={len(self.data.valid or ())} | "
                f"device {self._device_name()} | run dir {self.run_dir}"
                f"\n{plan_summary(self.memory_plan)}")

    def _compiled(self) -> str:
        if self.cfg.train.compile_scope == "model":
            return "model (one graph)"
        return f"blocks={self.backend.compiled_blocks}"

    def _eval_wrap_warning(self) -> Optional[str]:
        """An evaluation larger than the validation set wraps around it (eval_batches) and counts
        its first samples twice: a loss that is not the set's mean, said once, before training."""
        t, valid = self.cfg.train, self.data.valid
        if not t.eval_interval or valid is None:
            return None
        return eval_wrap_problem(t.eval_steps, self.layout.global_batch_size, len(valid))

    def _padding_summary(self) -> str:
        padded = self.dims.padded_vocab_size
        return f" padded to {padded}" if padded != self.dims.vocab_size else ""

    def _moe_summary(self) -> str:
        moe = self.dims.moe
        if moe is None:
            return ""
        dropping = "dropless" if moe.capacity_factor is None else f"capacity {moe.capacity_factor}"
        return (f" moe={self.dims.num_moe_blocks} blocks x {moe.num_experts} experts top-{moe.top_k} {dropping}"
                f"{f' +{moe.shared_experts} shared' if moe.shared_experts else ''}")

    def _device_name(self) -> str:
        """This rank's device, with the GPU's name: 'cuda:0 (NVIDIA H100 80GB HBM3)', or 'cpu'."""
        device = self.backend.device
        if device.type == "cuda":
            return f"{device} ({torch.cuda.get_device_name(device)})"
        return str(device)

    def _log_model_states(self) -> None:
        """Once per process, after its first step: every rank's held model states, to rank 0 (collective).
        metrics.jsonl gets them once per run (step 1), so a resumed run's records equal an uninterrupted one's."""
        per_rank = gather_model_states(self.backend.held_model_states())
        self._model_states_logged = True
        if self.is_logger:
            if self.step == 1:  # metrics.jsonl only: W&B's charts take scalars, not per-rank tables
                self.metrics.append({**model_states_record(self.step, per_rank, self.memory_plan, self.layout.grid),
                                     "consumed_samples": self.consumed_samples})
            (self.progress.write if self.progress else print)(model_states_line(per_rank, self.memory_plan))

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> None:
        """Train to train.max_steps (or train.exit_at_step), evaluating and saving on schedule."""
        t = self.cfg.train
        self.step = self.checkpoints.resume()
        self._resized = self.checkpoints.resized  # a resume into another world size: logged once W&B is up
        self._start_step = self.step  # a signal before any new step has nothing new to save
        if self.is_logger:
            print(self._summary(), flush=True)
            if problem := self._eval_wrap_warning():
                print(f"megaframe: warning: {problem}", flush=True)
            layout = {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp,
                      **({"cp": self.layout.cp} if self.layout.cp > 1 else {})}
            wandb_config = {**dataclasses.asdict(self.cfg),
                            "run": run_metadata(self.layout.world_size, layout, self.backend.versions(), self.engine)}
            self.wandb = WandbRun(self.cfg.logging.wandb, self.run_dir, wandb_config, *self._wandb_names())
            self.progress = Progress(t.max_steps, self.step, enabled=wants_bar(self.cfg.logging.progress_bar))
            if self._resized is not None:
                self._log(self._resized)
        stop_at = t.exit_at_step or t.max_steps
        if self.step == 0 and t.eval_interval:
            self._log({"step": 0, "eval_loss": self.evaluate(), "consumed_samples": 0})
        losses, interval_steps, interval_time = [], 0, 0.0
        while self.step < stop_at:
            if signum := self.stop_signal.agreed(self.backend.device):  # the same boundary on every rank
                self._stop_on_signal(signum)
                break
            start = time.perf_counter()
            result, lr = self.train_step()
            interval_time += (seconds := time.perf_counter() - start)
            self.stop_signal.note_step(seconds)
            interval_steps += 1
            event = self.guard.after_step(self.step, result.loss, result.applied, self._loss_scale_can_shrink())
            if event is not None:
                self._log_event(event)
                if event.action == "stopped":
                    raise Diverged(event.message)
            if math.isfinite(result.loss):  # the curve shows what every step computed; a NaN would hide the rest
                losses.append(result.loss)
            self.last_loss = result.loss
            if not self._model_states_logged:
                self._log_model_states()
            if self.step % t.log_interval == 0 or self.step == stop_at:
                mean_loss = math.fsum(losses) / len(losses) if losses else float("nan")
                record = self._train_record(result.loss, mean_loss, lr, interval_steps, interval_time)
                self._log(record)
                if self.progress:
                    self.progress.update(self.step, record)
                losses, interval_steps, interval_time = [], 0, 0.0
            if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.max_steps):
                eval_loss = self.last_eval_loss = self.evaluate()
                self._log({"step": self.step, "eval_loss": eval_loss, "consumed_samples": self.consumed_samples})
                if self.progress:
                    self.progress.write(f"step {self.step}: eval_loss {eval_loss:.4f}")
            self.checkpoints.save_if_due(self.step, stop_at)
        self.checkpoints.finished(self.step)  # the run is done: the fast tier's parts leave the nodes' memory

    def _stop_on_signal(self, signum: int) -> None:
        """A rank got a stop signal (stop_signal.py): save the steps done (train.save_on_signal) and end the loop."""
        self.stopped_by = signum
        # not when the signal came during this very step's periodic save, which it waited for
        saves = (self.cfg.train.save_on_signal and self.step > self._start_step
                 and self.checkpoints.saved_step != self.step)
        if self.is_logger:
            print(f"megaframe: {StopSignal.name(signum)}: stopping after step {self.step}"
                  + (", saving first" if saves else ""), flush=True)
        if saves:
            self.checkpoints.save(self.step)

    def close(self, failed: bool = False) -> None:
        """Flush W&B and remove swap files; after a clean run, wait for every rank (avoids aborts at
        interpreter exit). After a failure there is no barrier: the other ranks may be blocked in a
        collective this rank will never join, and a barrier would turn the error into a hang."""
        save_error, run_failed = None, failed
        try:
            with self.stop_signal.unguarded():
                self.checkpoints.wait()  # a checkpoint still being written is finished, failure or not
        except (RuntimeError, SaveFailed) as err:
            save_error, failed = err, True
        if self.progress:
            self.progress.close()
        if self.is_logger:
            print(self._closing_line(failed), flush=True)
        if self.wandb:
            self.wandb.finish(exit_code=1 if failed else 0)
        self.backend.close()
        if save_error is not None and not run_failed:  # else the run's own error is the one to report
            raise save_error
        if dist.is_initialized() and not failed:
            dist.barrier()

    def _closing_line(self, failed: bool) -> str:
        """The run's last line: how it ended, where, the losses, tokens and time, what to pick up next."""
        t = self.cfg.train
        if failed:
            ended = "failed"
        elif self.stopped_by:
            ended = f"stopped by {StopSignal.name(self.stopped_by)}"
        elif self.step < t.max_steps:
            ended = f"stopped early (train.exit_at_step={t.exit_at_step})" if t.exit_at_step else "stopped"
        else:
            ended = "finished"
        parts = [f"megaframe: {ended} at step {self.step}/{t.max_steps}"]
        losses = [f"loss {value:.4f}" if abs(value) < 1e4 else f"loss {value:.4g}"
                  for value in (self.last_loss,) if value is not None]
        if self.last_eval_loss is not None:  # next to a uniform guess, and in bits: did the run learn?
            losses.append(eval_summary(self.last_eval_loss, self.dims.vocab_size, self.cfg.data.tokenizer))
        if losses:
            parts.append(" ".join(losses))
        minutes, seconds = divmod(int(time.monotonic() - self.started), 60)
        tokens = self.step * self.tokens_per_step
        amount = next(f"{tokens / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                      if tokens >= scale or scale == 1)
        parts.append(f"{amount} tokens in {minutes}m{seconds:02d}s")
        try:
            last = self.last_checkpoint or checkpoint.find_latest(self.checkpoint_dir)
        except CheckpointError:  # an edited `latest`: the run's error line says so
            last = None
        parts.append(f"last checkpoint {last or 'none'}")
        if last is not None and ended != "finished":
            parts.append(f"resume: {resume_command(self.run_dir)}")
        if self.wandb and (hint := self.wandb.sync_hint()):
            parts.append(f"W&B offline: {hint}")
        return " | ".join(parts)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def train(cfg: TrainConfig, layout: Layout, run_dir: Path, rank: int = 0) -> int:
    """Entry point for one rank: build everything, fit, shut down cleanly; return the exit code.

    A failure is reported here, while the process group still exists (one rank prints its line,
    training/failure_report.py); a collective that timed out becomes RankHung naming the rank that
    never arrived."""
    trainer: Optional[Trainer] = None
    try:
        trainer = Trainer(cfg, layout, run_dir)
        with trainer:
            trainer.fit()
        return signal_exit_code(trainer.stopped_by) if trainer.stopped_by else 0
    except Exception as err:
        if is_collective_timeout(err):
            timeout = cfg.train.collective_timeout_s
            step = trainer.step + 1 if trainer is not None else 0
            hung = RankHung(describe_hang(step, timeout, wait_s=min(30.0, timeout)))
            hung.__cause__ = err
            err = hung
        return report_failure(err, run_dir, dist.get_rank() if dist.is_initialized() else rank)
    finally:
        if trainer is not None:
            trainer.stop_signal.restore()
        if not run_lock.held_by_parent(run_dir):
            run_lock.release(run_dir)  # a no-op unless this rank took it: a -m sweep runs its jobs in one process
        if dist.is_initialized():
            dist.destroy_process_group()
