"""The training loop: data -> backend steps -> metrics -> evals -> checkpoints -> W&B.

The loop and evaluation live here. What the run reports is the callbacks' (training/reporting.py);
checkpoints are the CheckpointManager's (checkpoint/manager.py), handed the run's named parts;
everything engine-specific goes through a Backend (megaframe/backends/), so this module never
imports DeepSpeed.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaframe.backends import StepResult
from megaframe.backends.registry import run_engine
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout
from megaframe.data import micro_batches, eval_batches
from megaframe.checkpoint import tokenizer_check
from megaframe.checkpoint.manager import CheckpointManager
from megaframe.checkpoint.parts import Plain
from megaframe.checkpoint.run_parts import BlendCursor, DataOrder, RunRecord, TokenizerRecord, TrainState
from megaframe.checkpoint.optimizer_check import RECORD_KEY as OPTIMIZER_RECORD, OptimizerRecord
from megaframe.training.data_setup import DataSplits, build_data
from megaframe.training.failure_report import report_failure, translate
from megaframe.training.faults import Faults
from megaframe.training.schedule import lr_scheduler_factory
from megaframe.training.reporting import Reporting
from megaframe.training.startup_checks import check_token_ids_fit, own_run_dir
from megaframe.training.step_guard import StepGuard, loss_scale_can_shrink
from megaframe.training.stop_signal import StopSignal, exit_code as signal_exit_code
from megaframe.common import run_lock
from megaframe.common.startup import resume_collector
from megaframe.common.failures import Diverged, SaveFailed, classify
from megaframe.model.dims import document_dims
from megaframe.model.factory import resolve_dims
from megaframe.parallel.context import zigzag_positions
from megaframe.parallel.state import ParallelState
from megaframe.tracking.metrics import MetricsLog


class Trainer:
    """Owns one run: the backend, the data, the loop and everything it writes to the run dir."""

    def __init__(self, cfg: TrainConfig, layout: Layout, run_dir: Path):
        self.cfg, self.layout, self.run_dir = cfg, layout, Path(run_dir)
        # first: a Ctrl-C while the model builds stops the run before step 1 instead of a traceback
        self.stop_signal = StopSignal(layout.world_size).install()
        self.stopped_by = 0  # the signal that ended the run at a step boundary
        self.fails_again = False  # it failed in a way a rerun repeats (__exit__)
        plug = run_engine(cfg, layout.world_size)
        self.engine = plug.name  # deepspeed, fsdp2, or plain (one process, DeepSpeed not imported)
        with self.stop_signal.joining():  # a signal while peers are awaited ends this rank at once
            plug.init_distributed(cfg.train.collective_timeout_s, cfg.train.join_timeout_s)
        self.ps = ParallelState.build(layout.grid)
        self.is_logger = self.ps.rank == 0
        if self.is_logger:
            self.stop_signal.watch_requests()  # launcher=ray: the driver's signal, written to a file
        own_run_dir(self.run_dir)  # before anything is written to it
        if self.is_logger:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data: DataSplits = build_data(cfg.data, cfg.model.seq_length)
        tokenizer = tokenizer_check.run_record(cfg.data)  # saved with checkpoints, checked on resume
        # context parallelism: the cp ranks of one dp rank read the same samples, each keeping only
        # its zig-zag shard of every sequence (cut by the data path, before tensors are made)
        self.token_positions = (zigzag_positions(cfg.model.seq_length, layout.cp, self.ps.cp_rank).numpy()
                                if layout.cp > 1 else None)
        self.dims = document_dims(resolve_dims(cfg.model, self.data.vocab_size, tp=layout.tp,
                                               device_type=plug.device_type(), core_device=plug.device_type()),
                                  cfg.data, self.data.datasets[0].eod_id)
        torch.manual_seed(cfg.train.seed)  # dropout streams; weights come from init_parameters
        if cfg.precision.tf32:  # fp32 matmuls on TF32 tensor cores; false leaves torch's own setting
            torch.backends.cuda.matmul.allow_tf32 = True
        self.backend = plug.build(cfg, layout, self.ps, self.dims, lr_scheduler_factory(cfg.optim, cfg.train.max_steps))
        resume_collector()  # start-up ends with the engine built (megaframe/common/startup.py)
        self.num_parameters = self.backend.num_parameters
        check_token_ids_fit(self.data.datasets, self.dims.vocab_size, cfg.model.vocab_size is not None,
                            self.backend.device, self.ps.rank, layout.world_size)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.step = 0
        self.guard = StepGuard(cfg.train.spike, cfg.train.max_consecutive_skips, self.data.train.data_changes())
        self.report = Reporting(self, self.metrics)  # training/reporting.py: every line, record and W&B call
        self.faults = Faults(self.ps.rank)
        t, gbs = cfg.train, layout.global_batch_size
        self.checkpoints = CheckpointManager(cfg, layout, self.run_dir, self.backend, self.dims, self.metrics,
                                             self.ps.rank, self.stop_signal.unguarded, self.faults.in_save_hook)
        register = self.checkpoints.register  # the run's state, by name (adding one is a line here, no format change)
        register(tokenizer_check.RECORD_KEY, TokenizerRecord(tokenizer, t.resume_accept_tokenizer_change))
        register("train", TrainState(lambda: self.step, gbs, t.on_batch_size_change, self._at_step), inline=True)
        register("data", order := DataOrder(cfg.model.seq_length, t.seed, self.data, t.resume_accept_data_change))
        register("blend_cursor", BlendCursor(self.data, order, lambda: self.step, gbs))
        register("guard", Plain(self.guard))
        register("run", RunRecord(cfg, layout))
        register(OPTIMIZER_RECORD, OptimizerRecord(cfg.optim.name, t.resume_accept_optimizer_change))

    def _at_step(self, step: int) -> None:
        self.step = step  # the resume's step, set before its checks (a refusal's closing line names it)

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
                                self.cfg.train.seed, self.token_positions, self.dims.unlearned_after)
        batches = self.faults.batches(self.step + 1, batches)
        lr = self.backend.lr()
        injected = self.faults.before_step(self.step + 1, self.backend)
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
                               self.layout.micro_batch_size, self.ps.dp_rank, self.layout.dp, self.token_positions,
                               self.dims.unlearned_after)
        with self.stop_signal.unguarded():  # a stop signal waits for the evaluation, however long
            return self.backend.eval_step(batches)

    @property
    def last_checkpoint(self) -> Optional[Path]:
        """The last checkpoint this process wrote (the closing line names it)."""
        return self.checkpoints.last

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> None:
        """Train to train.max_steps (or train.exit_at_step), evaluating and saving on schedule."""
        t = self.cfg.train
        self.step = self.checkpoints.resume()
        self._resized = self.checkpoints.resized  # a resume into another world size: logged once W&B is up
        self._start_step = self.step  # a signal before any new step has nothing new to save
        self.report.on_start()  # the start-up summary, W&B and the progress bar
        if self._resized is not None:
            self.report.log(self._resized)
        stop_at = t.exit_at_step or t.max_steps
        if self.step == 0 and t.eval_interval:
            self.report.on_eval(self.evaluate())
        while self.step < stop_at:
            if signum := self.stop_signal.agreed(self.backend.device):  # the same boundary on every rank
                self._stop_on_signal(signum)
                break
            start = time.perf_counter()
            result, lr = self.train_step()
            self.stop_signal.note_step(seconds := time.perf_counter() - start)
            can_shrink = loss_scale_can_shrink(self.backend.precision_state(), self.cfg.precision.min_loss_scale)
            if (event := self.guard.after_step(self.step, result.loss, result.applied, can_shrink)) is not None:
                self.report.on_event(event)
                if event.action == "stopped":
                    raise Diverged(event.message)
            self.report.on_step(result, lr, seconds)  # the step record, the model-state line
            if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.max_steps):
                self.report.on_eval(self.evaluate())
            self.checkpoints.save_if_due(self.step, stop_at)
        self.stop_signal.finished()  # a signal after the last step waits for nothing: no watchdog in the last save
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
            self.checkpoints.save(self.step, stopping=True)

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
        self.report.on_close(failed)  # the bar, the closing line, W&B
        self.backend.close()
        if save_error is not None and not run_failed:  # else the run's own error is the one to report
            raise save_error
        if dist.is_initialized() and not failed:
            dist.barrier()
        if not failed and not self.stopped_by:  # a stopped run's time is the scheduler's: the next one deletes
            self.checkpoints.trash_deleted()  # rank 0 alone, after the barrier: no rank waits on a delete

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # a failure a rerun repeats (a resume refused, bad data, divergence): the closing line offers no resume
        self.fails_again = exc is not None and classify(exc).deterministic
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
        err = translate(err, trainer.step + 1 if trainer is not None else 0, cfg.train.collective_timeout_s)
        return report_failure(err, run_dir, dist.get_rank() if dist.is_initialized() else rank)
    finally:
        if trainer is not None:
            trainer.stop_signal.restore()
        if not run_lock.held_by_parent(run_dir):
            run_lock.release(run_dir)  # a no-op unless this rank took it: a -m sweep runs its jobs in one process
        if dist.is_initialized():
            dist.destroy_process_group()
