"""The training loop: data -> backend steps -> metrics -> evals -> checkpoints -> W&B.

The loop, evaluation and checkpoint policy live here; what the run reports is the callbacks' of
training/reporting.py, and everything engine-specific goes through a Backend (megaframe/backends/),
so this module never imports DeepSpeed.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from datetime import timedelta
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
from megaframe.training import checkpoint, resume_checks, tokenizer_check
from megaframe.training.data_setup import DataSplits, build_data
from megaframe.training.failure_report import report_failure, translate
from megaframe.training.fast_checkpoint import FastTier
from megaframe.model.moe import load_router_biases, router_biases
from megaframe.training.faults import Faults
from megaframe.training.schedule import lr_scheduler_factory
from megaframe.training.reporting import Reporting
from megaframe.training.startup_checks import check_token_ids_fit, own_run_dir
from megaframe.training.step_guard import StepGuard, scale_can_shrink
from megaframe.training.stop_signal import StopSignal, exit_code as signal_exit_code
from megaframe.common import run_lock
from megaframe.common.startup import resume_collector
from megaframe.common.failures import Diverged, SaveFailed, save_failure
from megaframe.model.factory import resolve_dims
from megaframe.parallel.context import zigzag_positions
from megaframe.parallel.random import TPDropoutRNG
from megaframe.parallel.state import ParallelState
from megaframe.tracking.metrics import MetricsLog


class Trainer:
    """Owns one run: the backend, the data, the loop and everything it writes to the run dir."""

    def __init__(self, cfg: TrainConfig, layout: Layout, run_dir: Path):
        self.cfg, self.layout, self.run_dir = cfg, layout, Path(run_dir)
        # first: a Ctrl-C while the model builds stops the run before step 1 instead of a traceback
        self.stop_signal = StopSignal(layout.world_size).install()
        self.stopped_by = 0  # the signal that ended the run at a step boundary
        self.saved_step: Optional[int] = None
        plug = run_engine(cfg, layout.world_size)
        self.engine = plug.name  # deepspeed, fsdp2, or plain (one process, DeepSpeed not imported)
        with self.stop_signal.joining():  # a signal while peers are awaited ends this rank at once
            plug.init_distributed(cfg.train.collective_timeout_s, cfg.train.join_timeout_s)
        self.ps = ParallelState.build(layout.grid)
        self.is_logger = self.ps.rank == 0
        own_run_dir(self.run_dir, self.is_logger, layout.world_size)  # before anything is written to it
        if self.is_logger:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data: DataSplits = build_data(cfg.data, cfg.model.seq_length)
        self.tokenizer_record = tokenizer_check.run_record(cfg.data)  # saved with checkpoints, checked on resume
        # context parallelism: the cp ranks of one dp rank read the same samples, each keeping only
        # its zig-zag shard of every sequence (cut by the data path, before tensors are made)
        self.token_positions = (zigzag_positions(cfg.model.seq_length, layout.cp, self.ps.cp_rank).numpy()
                                if layout.cp > 1 else None)
        self.dims = resolve_dims(cfg.model, self.data.vocab_size, tp=layout.tp, device_type=plug.device_type())
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
        self.guard = StepGuard(cfg.train.spike, cfg.train.max_consecutive_skips)
        self.last_checkpoint: Optional[Path] = None
        self.report = Reporting(self, self.metrics)  # training/reporting.py: every line, record and W&B call
        self.faults = Faults(self.ps.rank)
        self.background = checkpoint.BackgroundWriter()  # train.async_save: each rank writes its shard on a thread
        self.fast: Optional[FastTier] = None  # train.fast_save_interval: parts in node-local memory and a buddy's
        if cfg.train.fast_save_interval:
            self.fast = FastTier(Path(cfg.train.fast_save_dir), self.run_dir, self.ps.rank, layout.world_size,
                                 timedelta(seconds=cfg.train.collective_timeout_s))

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
                               self.layout.micro_batch_size, self.ps.dp_rank, self.layout.dp, self.token_positions)
        with self.stop_signal.unguarded():  # a stop signal waits for the evaluation, however long
            return self.backend.eval_step(batches)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _restore_fast_tier(self) -> None:
        """train.resume=auto with the fast tier: parts in node-local memory newer than the shared
        checkpoint become a shared checkpoint first (training/fast_checkpoint.py), which the resume
        below then loads like any other."""
        shared = [0]
        if self.is_logger:
            try:
                latest = checkpoint.find_latest(self.checkpoint_dir) if self.checkpoint_dir.is_dir() else None
            except CheckpointError:
                latest = None  # the resume below says why
            shared[0] = int(latest.name.removeprefix("global_step")) if latest is not None else 0
        if dist.is_initialized():  # rank 0's view of shared storage decides, on every rank alike
            dist.broadcast_object_list(shared, src=0)
        keep = self.cfg.train.keep_checkpoints
        line = self.fast.restore(self.checkpoint_dir, shared[0], lambda tmp, step, world: checkpoint.publish_dir(
            tmp, self.checkpoint_dir, step, world, keep))
        if line and self.is_logger:
            print(line, flush=True)

    def _resume(self) -> None:
        verified = self.cfg.train.resume == "auto"
        if verified and self.fast is not None:
            self._restore_fast_tier()
        if verified:  # the newest checkpoint that verifies; a corrupt newer one is skipped, said in one line
            path, skipped = checkpoint.newest_verified(self.checkpoint_dir)
            if path is not None and not (self.checkpoint_dir / checkpoint.LATEST).is_file() and self.is_logger:
                print(f"megaframe: warning: {self.checkpoint_dir / checkpoint.LATEST} is missing: resuming from the "
                      f"newest checkpoint that verifies, {path.name} (train.resume=none starts over)",
                      file=sys.stderr, flush=True)
            if self.is_logger and (gone := resume_checks.gone_latest_warning(self.checkpoint_dir, path)):
                print(gone, file=sys.stderr, flush=True)
            if skipped and self.is_logger:
                print(f"megaframe: warning: resume skipped {len(skipped)} newer checkpoint(s) that do not verify: "
                      f"{'; '.join(skipped)}; resuming from {path.name}", file=sys.stderr, flush=True)
        else:
            path = checkpoint.resolve_resume(self.cfg.train.resume, self.checkpoint_dir)
        if path is None:
            self._start_over()
            return
        accept_tokenizer = self.cfg.train.resume_accept_tokenizer_change
        tokenizer_check.check_resume(path, self.tokenizer_record, self.is_logger,  # the cause of a vocabulary change
                                     accept=accept_tokenizer)
        checkpoint.check_model_shape(path, self.dims)
        point = checkpoint.load_any(self.backend, path, verified=verified,
                                    trust_pickled=self.cfg.train.trust_pickled_checkpoint)
        if "format" not in point.client_state:  # the engine's own files: their client state is read only now
            tokenizer_check.check_resume(path, self.tokenizer_record, self.is_logger, point.client_state,
                                         accept=accept_tokenizer)
        self.step = point.step
        self._check_batch_size(path, point.client_state)
        data_changed = self._check_data_order(path, point.client_state)
        self.guard.load_state_dict(point.client_state.get("guard", {}))
        load_router_biases(getattr(self.backend.module, "moe_layers", []), point.client_state.get("router_biases", {}))
        blend_cursor = point.client_state.get("blend_cursor")
        if self.data.blended and blend_cursor is not None and not data_changed:
            # saves re-walking the blend from sample 0; where it is absent the walk gives the same samples
            self.data.train.restore(blend_cursor)
        if "tp_dropout" in point.rng_state:
            self.backend.module.rng.load_state_dict(point.rng_state["tp_dropout"])
        elif point.client_state.get("format") == "megaframe-universal":  # resharded
            # per-rank RNG streams do not map onto another layout: restart them from (seed, step)
            seed = self.cfg.train.seed + self.step
            self.backend.module.rng.load_state_dict(TPDropoutRNG(seed, self.ps.tp_rank, self.ps.cp_rank).state_dict())
            torch.manual_seed(seed)
        if self.is_logger:
            dropped = self.metrics.truncate_after(self.step)
            print(f"resumed from {path} at step {self.step}"
                  + (f" (dropped {dropped} metrics records logged after it)" if dropped else ""), flush=True)
            now = resume_checks.run_record(self.cfg, self.layout)
            if line := resume_checks.change_line(path, point.client_state, now):  # layout, engine, schedule
                print(line, flush=True)
            self._resized = self._resize_event(point.client_state.get("layout") or {})

    def _start_over(self) -> None:
        """No checkpoint to resume from: refused on every rank when the run dir says one should be
        there, else step 0 (resume_checks.start_over)."""
        resume_checks.start_over(self.run_dir, self.checkpoint_dir, self.cfg.train.resume, self.metrics,
                                 self.is_logger, self.layout.world_size > 1)

    def _check_data_order(self, path: Path, state: dict) -> bool:
        """A resume that changes the data order is refused unless train.resume_accept_data_change
        (resume_checks.py); returns whether it changes."""
        record = resume_checks.data_record(self.cfg.model.seq_length, self.cfg.train.seed, self.data)
        return resume_checks.check_data_order(path, state, record, self.cfg.train.resume_accept_data_change,
                                              self.is_logger)

    def _resize_event(self, saved: dict) -> Optional[dict]:
        """A resume into another world size (an elastic restart after a node left or joined, or a
        resharded run): one event in metrics.jsonl and W&B, and one console line, at the first step
        the new world runs (a later resume from an earlier step drops it with the steps after it)."""
        size = lambda record: math.prod(record.get(axis, 1) for axis in ("tp", "pp", "dp", "cp"))  # noqa: E731
        if not saved or size(saved) == self.layout.world_size or self.step >= self.cfg.train.max_steps:
            return None  # no resize, or no step left to run at the new size
        event = {"step": self.step + 1, "event": "resized", "world_size": self.layout.world_size, "dp": self.layout.dp,
                 "previous_world_size": size(saved), "previous_dp": saved.get("dp", 1)}
        print(f"from step {self.step + 1}: world size {event['previous_world_size']} -> {self.layout.world_size} "
              f"(dp {event['previous_dp']} -> {self.layout.dp})", flush=True)
        return event  # logged once W&B is up

    def _check_batch_size(self, path: Path, state: dict) -> None:
        """A changed global batch size moves the data position (samples of step k are a function of
        (seed, k, global batch)): refused unless train.on_batch_size_change=move_position says so."""
        saved = state.get("global_batch_size")
        if saved is None or saved == self.layout.global_batch_size:
            return
        consumed = state.get("consumed_samples", self.step * saved)
        moved = self.step * self.layout.global_batch_size
        if self.cfg.train.on_batch_size_change != "move_position":
            raise CheckpointError(
                f"train.resume: checkpoint {path} was trained with parallel.global_batch_size={saved} "
                f"({consumed} samples consumed); this run's {self.layout.global_batch_size} would move the data "
                f"position to sample {moved}: set parallel.global_batch_size={saved}, or accept the move with "
                f"train.on_batch_size_change=move_position")
        if self.is_logger:
            print(f"megaframe: warning: parallel.global_batch_size {saved} -> {self.layout.global_batch_size} "
                  f"(train.on_batch_size_change=move_position): the data position moves from sample {consumed} "
                  f"to {moved}", file=sys.stderr, flush=True)

    def _fast_save(self) -> None:
        """This rank's part of a checkpoint into node-local memory and its buddy's (no shared storage)."""
        with self.stop_signal.unguarded():  # a stop signal waits for the save (the watchdog guards steps only)
            state, write_universal, _ = self._checkpoint_state(defer=False)
            rng = {"tp_dropout": self.backend.module.rng.state_dict()}
            try:
                self.fast.save(self.step, lambda part: checkpoint.write_rank_part(part, self.ps.rank, state, rng,
                                                                                  write_universal)())
            except OSError as err:  # /dev/shm full (64 MB in a default container), or not writable
                raise save_failure(err, f"the fast-tier part of step {self.step}",
                                   self.cfg.train.fast_save_dir) from err

    def _save(self) -> None:
        with self.stop_signal.unguarded():  # a stop signal waits for the save, minutes on a 7B (not 3 steps)
            state, write_universal, native = self._checkpoint_state(defer=self.cfg.train.async_save)
            self.saved_step = self.step
            try:
                self._write_checkpoint(state, write_universal, native)
            except OSError as err:  # a full disk or a quota: which checkpoint, why, and that the last one stands
                raise save_failure(err, f"global_step{self.step}", str(self.checkpoint_dir)) from err

    def _checkpoint_state(self, defer: bool):
        """What a checkpoint of this step holds: the client state, the function that writes this
        rank's layout-free shard (None without one), and whether DeepSpeed's own files are written."""
        state = {"step": self.step, "consumed_samples": self.consumed_samples,
                 "global_batch_size": self.layout.global_batch_size, "layout": self.backend.layout_record(),
                 "guard": self.guard.state_dict(), "run": resume_checks.run_record(self.cfg, self.layout),
                 "data": resume_checks.data_record(self.cfg.model.seq_length, self.cfg.train.seed, self.data),
                 tokenizer_check.RECORD_KEY: self.tokenizer_record}
        if biases := router_biases(getattr(self.backend.module, "moe_layers", []), self.dims.num_moe_blocks,
                                   self.ps.pp_group):
            state["router_biases"] = biases  # MoE bias balancing: whole per layer, the same on every rank
        if self.data.blended:
            state["blend_cursor"] = self.data.train.cursor_at(self.consumed_samples,
                                                              self.layout.global_batch_size).state_dict()
        write_universal = None
        if self.cfg.train.universal_checkpoint and self.backend.writes_layout_free:
            tokenizer = Path(self.cfg.data.tokenizer)
            universal_state = {**state, "model": {**dataclasses.asdict(self.cfg.model), "vocab_size": self.dims.vocab_size},
                               "tokenizer": self.cfg.data.tokenizer, "data_seed": self.cfg.train.seed}
            write_universal = lambda tmp_dir: self.backend.save_full_state(  # noqa: E731
                tmp_dir, universal_state, tokenizer if tokenizer.is_dir() else None, defer=defer)
        # one copy by default: DeepSpeed's own files only when asked, or when there is no layout-free copy
        native = self.cfg.train.native_checkpoint or write_universal is None
        return state, write_universal, native

    def _write_checkpoint(self, state: dict, write_universal, native: bool) -> None:
        self.last_checkpoint = checkpoint.save(self.backend, self.checkpoint_dir, self.step, state,
                        rng_state={"tp_dropout": self.backend.module.rng.state_dict()}, write_extra=write_universal,
                        keep=self.cfg.train.keep_checkpoints, native=native,
                        background=self.background if self.cfg.train.async_save else None,
                        before_publish=self.faults.in_save_hook(self.step),
                        record_timeout_s=self.cfg.train.collective_timeout_s)

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> None:
        """Train to train.max_steps (or train.exit_at_step), evaluating and saving on schedule."""
        t = self.cfg.train
        self._resized: Optional[dict] = None  # a resume into another world size (_resize_event)
        self._resume()
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
            can_shrink = scale_can_shrink(self.backend.precision_state(), self.cfg.precision.min_loss_scale)
            if (event := self.guard.after_step(self.step, result.loss, result.applied, can_shrink)) is not None:
                self.report.on_event(event)
                if event.action == "stopped":
                    raise Diverged(event.message)
            self.report.on_step(result, lr, seconds)  # the step record, the model-state line
            if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.max_steps):
                self.report.on_eval(self.evaluate())
            if (t.save_interval and self.step % t.save_interval == 0) or self.step == stop_at:
                self._save()
            elif self.fast is not None and self.step % t.fast_save_interval == 0:
                self._fast_save()
        if self.fast is not None and self.step >= t.max_steps:
            self.fast.clear()  # the run is done: its parts leave the nodes' memory

    def _stop_on_signal(self, signum: int) -> None:
        """A rank got a stop signal (stop_signal.py): save the steps done (train.save_on_signal) and end the loop."""
        self.stopped_by = signum
        # not when the signal came during this very step's periodic save, which it waited for
        saves = self.cfg.train.save_on_signal and self.step > self._start_step and self.saved_step != self.step
        if self.is_logger:
            print(f"megaframe: {StopSignal.name(signum)}: stopping after step {self.step}"
                  + (", saving first" if saves else ""), flush=True)
        if saves:
            self._save()

    def close(self, failed: bool = False) -> None:
        """Flush W&B and remove swap files; after a clean run, wait for every rank (avoids aborts at
        interpreter exit). After a failure there is no barrier: the other ranks may be blocked in a
        collective this rank will never join, and a barrier would turn the error into a hang."""
        save_error, run_failed = None, failed
        try:
            with self.stop_signal.unguarded():
                self.background.wait()  # a checkpoint still being written is finished, failure or not
        except (RuntimeError, SaveFailed) as err:
            save_error, failed = err, True
        self.report.on_close(failed)  # the bar, the closing line, W&B
        self.backend.close()
        if save_error is not None and not run_failed:  # else the run's own error is the one to report
            raise save_error
        if dist.is_initialized() and not failed:
            dist.barrier()

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
        err = translate(err, trainer.step + 1 if trainer is not None else 0, cfg.train.collective_timeout_s)
        return report_failure(err, run_dir, dist.get_rank() if dist.is_initialized() else rank)
    finally:
        if trainer is not None:
            trainer.stop_signal.restore()
        if not run_lock.held_by_parent(run_dir):
            run_lock.release(run_dir)  # a no-op unless this rank took it: a -m sweep runs its jobs in one process
        if dist.is_initialized():
            dist.destroy_process_group()
