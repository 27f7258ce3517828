"""The checkpoint manager: built once by the trainer, it saves and resumes the run's named parts.

The trainer registers its parts (checkpoint/parts.py, checkpoint/run_parts.py) and the backend's
own (backend.state_parts(): router biases, the TP dropout streams), then calls resume() once and
save_if_due() after every step. Everything else is the manager's:
- which checkpoint a resume starts from: the newest that verifies under train.resume=auto (a
  corrupt newer one skipped, said in one line), the fast tier's newer parts published first, or a
  start from step 0 when the run dir allows one (checkpoint/resume_checks.py);
- layout-free versus the engine's own files (train.universal_checkpoint, train.native_checkpoint),
  written in the background under train.async_save, pruned to train.keep_checkpoints;
- the RNG policy: a rank's streams (the default generators and every rank part) come back when the
  layout is the one they were saved in, and restart from (train.seed + step) when a layout-free
  checkpoint is resumed into another layout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch

from megaframe.checkpoint import resume_checks, store, universal
from megaframe.checkpoint.fast_tier import FastTier
from megaframe.checkpoint.parts import RankStateful, Resume, Stateful
from megaframe.checkpoint.staging import HostStaging
from megaframe.checkpoint.universal import CheckpointError
from megaframe.common.failures import save_failure
from megaframe.parallel.dims import RANK_AXES
from megaframe.parallel.rank_zero import decided_by_rank_zero


class CheckpointManager:
    """Saves and resumes one run's checkpoints under RUN_DIR/checkpoints (every rank builds one)."""

    def __init__(self, cfg, layout, run_dir: Path, backend, dims, metrics, rank: int,
                 shield: Callable[[], ContextManager] = contextlib.nullcontext,
                 save_hook: Callable[[int], Optional[Callable[[str], None]]] = lambda step: None):
        """cfg: TrainConfig; layout: its Layout; dims: the model's GPTDims; metrics: the run's
        MetricsLog (a resume drops the records after its step); shield: the context a save runs in
        (the stop signal waits for it); save_hook(step): the faults' hook inside a save, or None."""
        self.cfg, self.layout, self.backend, self.dims, self.metrics = cfg, layout, backend, dims, metrics
        self.run_dir, self.dir = Path(run_dir), Path(run_dir) / "checkpoints"
        self.rank, self.is_logger = rank, rank == 0
        self.shield, self.save_hook = shield, save_hook
        self.whole: list[tuple[str, Stateful, bool]] = []  # (name, part, inline), in registration order
        self.per_rank: list[tuple[str, RankStateful]] = []
        self.saved_step: Optional[int] = None  # the step of the last save this process began
        self.last: Optional[Path] = None  # the last checkpoint this process wrote
        self.resized: Optional[dict] = None  # rank 0: the metrics event of a resume into another world size
        # train.async_save: each rank writes its shard on a thread
        self.background = store.BackgroundWriter(self.dir, cfg.train.resume)
        self.staging: Optional[HostStaging] = None  # train.async_save: the host copies' buffers, kept between saves
        self.trash = store.TrashCollector()  # rank 0 deletes pruned checkpoints off the step loop
        self.fast: Optional[FastTier] = None  # train.fast_save_interval: parts in node-local memory and a buddy's
        t = cfg.train
        if t.fast_save_interval:
            self.fast = FastTier(Path(t.fast_save_dir), self.run_dir, rank, layout.world_size,
                                 timedelta(seconds=t.collective_timeout_s))
        # the engine's own state (router biases, dropout streams): saved and restored after the trainer's parts
        for name, part in backend.state_parts().items():
            self.register(name, part)
        self._engine_parts = (len(self.whole), len(self.per_rank))

    def register(self, name: str, part: Stateful, inline: bool = False) -> None:
        """Save `part` under `name` from now on and restore it on resume. A RankStateful part is
        this rank's own (rng_rank{R}.pt); inline: the part's dict goes to the client state's top
        level (the train state's step, consumed_samples, global_batch_size) and comes back whole."""
        taken = {n for n, _, _ in self.whole} | {n for n, _ in self.per_rank}
        # the keys the manager writes itself, and the inline train state's (a part under one of
        # them would overwrite it in the client state)
        reserved = ("layout", "model", "tokenizer", "data_seed", "format", "version", "step", "consumed_samples",
                    "global_batch_size")
        if name in taken or name in reserved:
            raise ValueError(f"a checkpoint part named {name!r} exists already")
        if isinstance(part, RankStateful):
            self.per_rank.append((name, part))
        else:
            self.whole.append((name, part, inline))

    def _whole(self) -> list[tuple[str, Stateful, bool]]:
        """The whole parts in the order they are saved and restored: the trainer's, then the engine's."""
        engine = self._engine_parts[0]
        return self.whole[engine:] + self.whole[:engine]

    def _per_rank(self) -> list[tuple[str, RankStateful]]:
        engine = self._engine_parts[1]
        return self.per_rank[engine:] + self.per_rank[:engine]

    # ---- saving ------------------------------------------------------------------------------
    def save_if_due(self, step: int, stop_at: int) -> None:
        """After step `step`: a checkpoint every train.save_interval steps and at stop_at, else the
        fast tier's part every train.fast_save_interval steps."""
        t = self.cfg.train
        if (t.save_interval and step % t.save_interval == 0) or step == stop_at:
            self.save(step)
        elif self.fast is not None and step % t.fast_save_interval == 0:
            self.fast_save(step)

    def save(self, step: int, stopping: bool = False) -> Path:
        """A checkpoint of step `step` (collective), published atomically; in the background under
        train.async_save. stopping: a stop signal's save, which waits for no delete of older ones (its
        time is the scheduler's). Returns its directory."""
        t = self.cfg.train
        with self.shield():  # a stop signal waits for the save, minutes on a 7B (not 3 steps)
            state, write_universal, native = self._state(staging=self._staging() if t.async_save else None)
            self.saved_step = step
            try:
                if self.is_logger:
                    self.metrics.sync()
                self.last = store.save(self.backend, self.dir, step, state, rng_state=self._rank_states(),
                                       write_extra=write_universal, keep=t.keep_checkpoints, native=native,
                                       background=self.background if t.async_save else None,
                                       before_publish=self.save_hook(step), record_timeout_s=t.collective_timeout_s,
                                       trash=self.trash, trash_wait_s=0.0 if stopping else store.TRASH_WAIT_S)
            except OSError as err:  # a full disk or a quota: which checkpoint, why, and that the last one stands
                self._not_published(t.async_save)
                tag = f"global_step{step}"
                raise save_failure(err, tag, str(self.dir), store.restart_point(self.dir, tag, t.resume)) from err
            except BaseException:
                self._not_published(t.async_save)
                raise
        return self.last

    def _not_published(self, background: bool) -> None:
        """A background save's failure surfaces at the next save or at the end: the checkpoint in
        flight, which `last` named, was never published, and the closing line named it beside the
        error saying the one before stands (review). Then `latest` says what is there."""
        if background:
            self.last = None

    def fast_save(self, step: int) -> None:
        """This rank's part of a checkpoint into node-local memory and its buddy's (no shared storage)."""
        with self.shield():
            state, write_universal, _ = self._state(staging=None)
            rng = self._rank_states()
            try:
                self.fast.save(step, lambda part: store.write_rank_part(part, self.rank, state, rng, write_universal)())
            except OSError as err:  # /dev/shm full (64 MB in a default container), or not writable
                raise save_failure(err, f"the fast-tier part of step {step}", self.cfg.train.fast_save_dir) from err

    def wait(self) -> None:
        """Block until the save in flight (train.async_save) is published; raise its error."""
        try:
            self.background.wait()
        except BaseException:
            self._not_published(True)
            raise

    def trash_deleted(self) -> None:
        """Block until rank 0's thread has deleted the pruned checkpoints: a clean run's end, after its
        last barrier (no rank waits on it; a failed run leaves them to the next publish)."""
        self.trash.wait()

    def finished(self, step: int) -> None:
        """The run reached train.max_steps: the fast tier's parts leave the nodes' memory, once the save
        in flight (train.async_save) is published. A final save that failed leaves them: they may be
        newer than the last good checkpoint, and close() reports the failure (exit 8)."""
        if self.fast is not None and step >= self.cfg.train.max_steps and self.background.published():
            self.fast.clear()

    def _staging(self) -> HostStaging:
        """The host buffers of this rank's background saves, made at the first one (page-locked on a GPU)."""
        if self.staging is None:
            self.staging = HostStaging(pin_device_copies=self.backend.device.type == "cuda")
        return self.staging

    def _state(self, staging: Optional[HostStaging]) -> tuple[dict[str, Any], Optional[Callable[[Path], Any]], bool]:
        """The client state (every whole part; a collective where a part's is), the function that
        writes this rank's layout-free shard (None without one), and whether the engine's own files
        are written."""
        state: dict[str, Any] = {"layout": self.backend.layout_record()}
        for name, part, inline in self._whole():
            value = part.state_dict()
            if inline:
                state.update(value)
            elif value is not None:
                state[name] = value
        c, write_universal = self.cfg, None
        if c.train.universal_checkpoint and self.backend.writes_layout_free:
            tokenizer = Path(c.data.tokenizer)
            universal_state = {**state, "model": {**dataclasses.asdict(c.model), "vocab_size": self.dims.vocab_size},
                               "tokenizer": c.data.tokenizer, "data_seed": c.train.seed}
            write_universal = lambda tmp_dir: self.backend.save_full_state(  # noqa: E731
                tmp_dir, universal_state, tokenizer if tokenizer.is_dir() else None, staging=staging)
        # one copy by default: the engine's own files only when asked, or when there is no layout-free copy
        return state, write_universal, c.train.native_checkpoint or write_universal is None

    def _rank_states(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._per_rank()}

    # ---- resuming ----------------------------------------------------------------------------
    def resume(self) -> int:
        """Resume per train.resume and return the step to go on from: 0 when the run starts over
        (refused on every rank when the run dir says a checkpoint should be there)."""
        t = self.cfg.train
        verified = t.resume == "auto"
        if verified and self.is_logger:
            self._finish_interrupted_swap()  # before anything lists the checkpoints (rank 0 lists them)
        if self.is_logger and self.dir.is_dir():  # what a crash or a stop left in the trash: space for this run's saves
            self._trash_unfinished_saves()
            self.trash.collect(self.dir)
        if verified and self.fast is not None:
            path = self._restore_fast_tier()
        else:
            path = self._newest_verified() if verified else store.resolve_resume(t.resume, self.dir)
        if not verified and self.fast is not None and (path is None or path.is_dir()):
            # resume=none, or a PATH that is there: the parts of the run's other steps are no longer its
            # own (a mistyped PATH fails on without losing them)
            self.fast.clear()
        if path is None:
            resume_checks.start_over(self.run_dir, self.dir, t.resume, self.metrics, self.is_logger)
            return 0
        for _, part, _ in self._whole():  # before any tensor is read (the cause of a vocabulary change)
            if hasattr(part, "precheck"):
                part.precheck(path, self.is_logger)
        store.check_model_shape(path, self.dims)
        point = store.load_any(self.backend, path, verified=verified, trust_pickled=t.trust_pickled_checkpoint)
        resume = Resume(path, point.step, point.client_state, point.layout_free, self.is_logger)
        for name, part, inline in self._whole():
            part.load_state_dict(point.client_state if inline else point.client_state.get(name), resume)
        self._restore_streams(point)
        if self.is_logger:
            dropped = self.metrics.truncate_after(point.step)
            print(f"resumed from {path} at step {point.step}"
                  + (f" (dropped {dropped} metrics records logged after it)" if dropped else ""), flush=True)
            if moved := store.set_aside_newer(self.dir, point.step, path):
                print(f"megaframe: the run goes on from step {point.step}: its newer checkpoints are set aside, out of "
                      f"pruning and train.resume=auto: {', '.join(p.name for p in moved)} (delete them when done)",
                      flush=True)
            for line in resume.notes:  # what changed: layout, engine, schedule
                print(line, flush=True)
            self.resized = self._resize_event(point.client_state.get("layout") or {}, point.step)
        return point.step

    def _restore_streams(self, point: store.ResumePoint) -> None:
        """The RNG policy. In the layout they were saved in, this rank's streams came back with the
        checkpoint (the default generators in store.load_any); per-rank streams do not map onto
        another layout: from a layout-free checkpoint they restart from (seed, step)."""
        seed = self.cfg.train.seed + point.step
        resume = Resume(point.path, point.step, point.client_state, point.layout_free, self.is_logger)
        for name, part in self._per_rank():
            if name in point.rng_state:
                part.load_state_dict(point.rng_state[name], resume)
            elif point.layout_free:
                part.reseed(seed)
        if point.layout_free and "cpu" not in point.rng_state:
            torch.manual_seed(seed)

    def _finish_interrupted_swap(self) -> None:
        """Rank 0: a checkpoint a crash left aside in the middle of being saved again comes back, in
        one line. Other ranks see the run's checkpoints through rank 0's listing, broadcast after this."""
        try:
            restored = universal.finish_interrupted_swaps(self.dir) if self.dir.is_dir() else []
        except OSError as err:  # the listing that follows says what the storage does; no rank waits on this one
            print(f"megaframe: warning: cannot put back checkpoints left aside in {self.dir} ({err})",
                  file=sys.stderr, flush=True)
            return
        for path in restored:
            print(f"megaframe: {path.name} was left aside by a crash while it was being saved again: put back",
                  file=sys.stderr, flush=True)

    def _trash_unfinished_saves(self) -> None:
        """Rank 0: the directories of saves a crash or a scheduler's kill cut short, in one line."""
        named = self.cfg.train.resume
        try:
            gone = store.trash_unfinished_saves(self.dir, None if named in ("auto", "none") else Path(named))
        except OSError as err:  # space only: the resume goes on, and the next one tries again
            print(f"megaframe: warning: cannot set aside unfinished saves in {self.dir} ({err})", file=sys.stderr,
                  flush=True)
            return
        if gone:
            print(f"megaframe: {', '.join(p.name for p in gone)}: left by a save that did not finish; deleting "
                  f"it", file=sys.stderr, flush=True)

    def _newest_verified(self, found: Optional[tuple[Optional[Path], list[str]]] = None) -> Optional[Path]:
        """train.resume=auto: the newest checkpoint that verifies, each fallback said in one line.
        Every rank calls it: the manifest check is a collective. found: store.newest_verified's
        answer when the caller has it."""
        path, skipped = found or store.newest_verified(self.dir)
        if not self.is_logger:
            return path
        if path is not None and not (self.dir / store.LATEST).is_file():
            print(f"megaframe: warning: {self.dir / store.LATEST} is missing: resuming from the "
                  f"newest checkpoint that verifies, {path.name} (train.resume=none starts over)",
                  file=sys.stderr, flush=True)
        if gone := resume_checks.gone_latest_warning(self.dir, path):
            print(gone, file=sys.stderr, flush=True)
        if skipped:
            print(f"megaframe: warning: resume skipped {len(skipped)} newer checkpoint(s) that do not verify: "
                  f"{'; '.join(skipped)}; resuming from {path.name}", file=sys.stderr, flush=True)
        return path

    def _restore_fast_tier(self) -> Optional[Path]:
        """train.resume=auto with the fast tier: parts in node-local memory newer than the shared
        checkpoint become a shared checkpoint first (checkpoint/fast_tier.py). Returns the checkpoint
        to resume from. Nodes that hold a step newer than the one `latest` names restore it, as
        ever. Nodes that hold an older one (the fast tier skips the save steps: after a save at
        step N it holds N - fast_save_interval) matter only when global_stepN does not verify: the
        floor is then the newest checkpoint that does, and their step, if newer, is restored rather
        than the resume falling back to that older checkpoint. The verification is the one the
        resume does anyway; only a restore after a damaged checkpoint hashes more."""
        def latest_step() -> int:  # rank 0's view of shared storage decides, on every rank alike
            try:
                latest = store.find_latest(self.dir) if self.dir.is_dir() else None
            except CheckpointError:
                latest = None  # the resume says why
            return int(latest.name.removeprefix("global_step")) if latest is not None else 0
        shared, held = decided_by_rank_zero(latest_step), self.fast.newest_complete()
        found: Optional[tuple[Optional[Path], list[str]]] = None
        none_verifies = None
        if 0 < held <= shared:
            try:
                found = store.newest_verified(self.dir)
                shared = int(found[0].name.removeprefix("global_step")) if found[0] is not None else 0
            except CheckpointError as err:  # every checkpoint damaged: the nodes' step may still be whole
                none_verifies, shared = err, 0
        keep = self.cfg.train.keep_checkpoints
        line = self.fast.restore(self.dir, shared, lambda tmp, step, world: store.publish_dir(
            tmp, self.dir, step, world, keep, self.trash))
        if line is None:
            if none_verifies is not None:
                raise none_verifies
            return self._newest_verified(found)
        if self.is_logger:
            print(line, flush=True)
        return self._newest_verified()  # the copy just published, checked like any other

    def _resize_event(self, saved: dict, step: int) -> Optional[dict]:
        """A resume into another world size (an elastic restart after a node left or joined, or a
        resharded run): one event for metrics.jsonl and W&B, and one console line, at the first step
        the new world runs (a later resume from an earlier step drops it with the steps after it)."""
        size = lambda record: math.prod(record.get(axis, 1) for axis in RANK_AXES)  # noqa: E731
        world = self.layout.world_size
        if not saved or size(saved) == world or step >= self.cfg.train.max_steps:
            return None  # no resize, or no step left to run at the new size
        event = {"step": step + 1, "event": "resized", "world_size": world, "dp": self.layout.dp,
                 "previous_world_size": size(saved), "previous_dp": saved.get("dp", 1)}
        print(f"from step {step + 1}: world size {event['previous_world_size']} -> {world} "
              f"(dp {event['previous_dp']} -> {self.layout.dp})", flush=True)
        return event
