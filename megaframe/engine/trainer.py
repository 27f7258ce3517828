"""The training loop: data -> DeepSpeed steps -> metrics -> evals -> checkpoints -> W&B."""
from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaframe.checkpoint import reshard
from megaframe.config.deepspeed import to_ds_config
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout, universal_checkpoint_unsupported
from megaframe.data import micro_batches, eval_batches
from megaframe.engine import checkpoint
from megaframe.engine.data_setup import DataSplits, build_data
from megaframe.engine.build_locks import clear_stale_build_locks
from megaframe.engine.nvme_swap import open_nvme_swap
from megaframe.engine.elastic import join_restarted_group
from megaframe.engine.schedule import lr_scheduler_factory
from megaframe.model.factory import build_model, compile_blocks, count_parameters, resolve_dims
from megaframe.model.pipeline import build_pipeline_model
from megaframe.parallel.random import TPDropoutRNG
from megaframe.parallel.state import ParallelState
from megaframe.plan.startup import (gather_model_states, memory_plan, model_states_line, model_states_record,
                                    plan_summary)
from megaframe.tracking.flops import flops_per_token, peak_tflops
from megaframe.tracking.metrics import MetricsLog, memory_gb, run_metadata
from megaframe.tracking.progress import Progress
from megaframe.tracking.wandb_run import WandbRun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Join the launcher's process group (or make a world of one when there is no launcher) and
    register it with deepspeed.comm, which PipelineModule needs before deepspeed.initialize."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized() and "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    join_restarted_group(get_accelerator().communication_backend_name())  # torchrun restarts
    if get_accelerator().device_name() == "cpu":
        # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op here (45 s on first use)
        # that only its inference path calls; training collectives go through torch.distributed.
        # DeepSpeed keeps edits to this dict (deepspeed/ops/__init__.py).
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; biases and norm gains are not decayed (as Megatron does)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# Elements per fp64 copy in _sum_of_squares: 2 MiB of fp64 stays in cache. Measured on the 2-core
# CPU machine (52 tensors, 34M elements): 0.23-0.37 ns/element at 2^18, 0.35-0.44 at 2^16, 2.0-4.0
# at 2^22 (the copy leaves the cache), 2.5-3.7 for a whole-tensor fp64 vector_norm, against
# 0.10-0.13 for an fp32 dot.
_SQUARES_CHUNK = 1 << 18


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of every element's square, as a 0-d fp64 tensor on the gradients' device.

    Each chunk is copied to fp64 before its dot product: the square of an fp32 value is exact in
    fp64 and n such squares sum with a relative error under n * 1.1e-16, so the result no longer
    depends on the host's vector width or thread count. An fp32 dot does: it was 2.9e-6 (one
    thread) and 1.3e-6 (two) off the exact norm on the same gradients, and 1.19e-5 apart between
    an AVX2 and an AVX-512 host after a few steps. Chunks bound the extra memory to one chunk.
    """
    if not grads:
        from deepspeed.accelerator import get_accelerator

        return torch.zeros((), dtype=torch.float64, device=get_accelerator().current_device_name())
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        for chunk in g.reshape(-1).split(_SQUARES_CHUNK):
            chunk = chunk.double()
            total += torch.dot(chunk, chunk)
    return total


def grad_norm(model: torch.nn.Module, ps: ParallelState) -> float:
    """L2 norm of the (already data-parallel-reduced) gradients, each parameter counted once.

    Tensor-parallel shards (marked `tensor_model_parallel`) are summed over the TP group and
    parameters replicated across TP ranks counted on TP rank 0 only; pipeline stages are summed,
    with a tied embedding counted once (DeepSpeed marks its other copies `ds_pipe_replicated`).
    Accumulated in fp64, as DeepSpeed's ZeRO optimizers do, so that curves compare across stages.
    """
    grads = [p.grad.detach() for p in model.parameters()
             if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
             and (ps.tp_rank == 0 or getattr(p, "tensor_model_parallel", False))]
    sq = _sum_of_squares(grads).reshape(1)
    for degree, group in ((ps.tp, ps.tp_group), (ps.pp, ps.pp_group)):
        if degree > 1:
            dist.all_reduce(sq, group=group)
    return sq.sqrt().item()


class Trainer:
    """Owns one run: the engine, the data, the loop and everything it writes to the run dir."""

    def __init__(self, cfg: TrainConfig, layout: Layout, run_dir: Path):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self.cfg, self.layout, self.run_dir = cfg, layout, Path(run_dir)
        init_distributed()
        self.ps = ParallelState.build(layout.tp, layout.pp, layout.dp)
        self.is_logger = self.ps.rank == 0
        if self.is_logger:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data: DataSplits = build_data(cfg.data, cfg.model.seq_length)
        self.dims = resolve_dims(cfg.model, self.data.vocab_size, tp=layout.tp)
        torch.manual_seed(cfg.train.seed)  # dropout streams; weights come from init_parameters
        p = cfg.parallel
        self.pipelined = layout.pp > 1
        if self.pipelined:
            model = build_pipeline_model(self.dims, self.ps, cfg.train.seed, p.pipeline_partition,
                                         p.activation_checkpointing, p.sequence_parallel)
        else:
            model = build_model(self.dims, self.ps, cfg.train.seed, p.activation_checkpointing, p.sequence_parallel)
        self.compiled_blocks = compile_blocks(model) if cfg.train.compile else 0
        self.model = model
        self.num_parameters = self._count_parameters(model)
        self.nvme_swap = open_nvme_swap(cfg.offload)
        clear_stale_build_locks()  # DeepSpeed JIT-loads its CPU ops in initialize
        ds_config = to_ds_config(cfg, layout, accelerator=get_accelerator().device_name(),
                                 swap_dir=str(self.nvme_swap.path) if self.nvme_swap else None)
        self.engine, _, _, self.lr_scheduler = deepspeed.initialize(
            model=model, model_parameters=decay_param_groups(model, cfg.optim.weight_decay),
            config=ds_config, lr_scheduler=lr_scheduler_factory(cfg.optim, cfg.train.max_steps),
            mpu=None if self.pipelined else self.ps)  # a PipelineModule brings its own grid as mpu
        self.flops_per_token = flops_per_token(self.dims)
        self.peak_tflops = peak_tflops(cfg.hardware.peak_tflops)
        self.tokens_per_step = layout.global_batch_size * cfg.model.seq_length
        self.memory_plan = memory_plan(cfg, layout)
        self._model_states_logged = False
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.wandb: Optional[WandbRun] = None
        self.progress: Optional[Progress] = None
        self.step = 0
        self.last_grad_norm = float("nan")
        self._norm_from_grads = cfg.zero.stage == 0 and cfg.precision.dtype == "fp32"
        if self._norm_from_grads:
            self._measure_and_clip_in_step()
        if self._norm_from_grads and not self.pipelined and layout.dp == 1:
            # one replica: DeepSpeed would still flatten, all-reduce (over a group of one) and copy
            # back every gradient each step; TP gradients are already summed inside autograd
            self.engine.enable_backward_allreduce = False

    def _measure_and_clip_in_step(self) -> None:
        """DeepSpeed's ZeRO and mixed-precision optimizers compute the global norm; at ZeRO-0 in fp32
        it clips through utils.clip_grad_norm_, which discards the norm and, under a pipeline,
        counts a tied embedding twice. There we measure and clip ourselves, where both engines
        hold final (reduced, unclipped) gradients: in _take_model_step."""
        take_model_step = self.engine._take_model_step
        self.engine._config.gradient_clipping = 0.0
        clip = self.cfg.optim.grad_clip

        def measure_clip_step(*args, **kwargs):
            self.last_grad_norm = grad_norm(self.engine.module, self.ps)
            if clip > 0 and self.last_grad_norm > clip:
                scale = clip / (self.last_grad_norm + 1e-6)
                torch._foreach_mul_([p.grad for p in self.engine.module.parameters() if p.grad is not None], scale)
            return take_model_step(*args, **kwargs)
        self.engine._take_model_step = measure_clip_step

    def _count_parameters(self, model: torch.nn.Module) -> int:
        """The whole model's parameters: TP shards at full size, pipeline stages summed."""
        local = sum(count_parameters(m, full=True) for m in model.children()
                    if not (self.pipelined and m is getattr(model, "tied_modules", None) and not self.ps.is_first_stage))
        if self.pipelined and self.ps.pp > 1:
            total = torch.tensor([local], dtype=torch.int64)
            dist.all_reduce(total, group=self.ps.pp_group)
            return int(total.item())
        return local

    @property
    def consumed_samples(self) -> int:
        """Samples trained on so far (the data position is a pure function of the step)."""
        return self.step * self.layout.global_batch_size

    # ---- collectives over the data-parallel replicas -----------------------------------------
    def _dp_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if self.layout.dp > 1:
            dist.all_reduce(t, group=self.ps.dp_group)
        return t.item() / self.layout.dp

    # ---- one optimizer step and one evaluation ------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """Run the step's micro-batches and advance self.step; return (mean loss over the global
        batch, lr used)."""
        batches = micro_batches(self.data.train, self.step, self.layout.global_batch_size,
                                self.layout.micro_batch_size, self.ps.dp_rank, self.layout.dp,
                                self.cfg.train.seed)
        lr = self.lr_scheduler.get_last_lr()[0]
        if self.pipelined:  # the engine runs the micro-batches through its 1F1B schedule
            loss = float(self.engine.train_batch(data_iter=iter(batches)))  # already averaged over DP
        else:
            total = 0.0
            for inputs, targets in batches:
                micro_loss = self.engine(inputs, targets)
                self.engine.backward(micro_loss)
                self.engine.step()
                total += micro_loss.item()
            loss = self._dp_mean(total / len(batches))
        if not self._norm_from_grads:
            self.last_grad_norm = float(self.engine.get_global_grad_norm())
        self.step += 1
        return loss, lr

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over train.eval_steps global batches of held-out samples (same in every layout)."""
        self.engine.eval()
        # eval_steps global batches, fed as micro-batches: the same samples in every layout
        batches = eval_batches(self.data.valid, self.cfg.train.eval_steps * self.layout.grad_accum_steps,
                               self.layout.micro_batch_size, self.ps.dp_rank, self.layout.dp)
        if self.pipelined:
            mean = float(self.engine.eval_batch(iter(batches), num_micro_batches=len(batches)))
        else:
            mean = sum(self.engine(inputs, targets).item() for inputs, targets in batches) / len(batches)
        self.engine.train()
        return self._dp_mean(mean)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _view(self) -> reshard.EngineView:
        return reshard.EngineView(self.engine, self.ps, self.dims, self.pipelined, self.cfg.zero.stage,
                                  self.cfg.precision.dtype)

    def _resume(self) -> None:
        path = checkpoint.resolve_resume(self.cfg.train.resume, self.checkpoint_dir)
        if path is None:
            if self.cfg.train.resume == "auto" and self.is_logger:
                # an attempt that crashed before its first checkpoint: its records would repeat
                dropped = self.metrics.truncate_after(-1)
                if dropped:
                    print(f"no checkpoint to resume from: dropped {dropped} metrics records of an earlier attempt",
                          flush=True)
            return
        view = self._view()
        point = checkpoint.load_any(self.engine, path, reshard.layout_record(view),
                                    lambda p: reshard.resume_universal(view, p, self.lr_scheduler))
        self.step = point.step
        if "tp_dropout" in point.rng_state:
            self.model.rng.load_state_dict(point.rng_state["tp_dropout"])
        elif point.client_state.get("format") == "megaframe-universal":  # resharded
            # per-rank RNG streams do not map onto another layout: restart them from (seed, step)
            seed = self.cfg.train.seed + self.step
            self.model.rng.load_state_dict(TPDropoutRNG(seed, self.ps.tp_rank).state_dict())
            torch.manual_seed(seed)
        if self.is_logger:
            dropped = self.metrics.truncate_after(self.step)
            print(f"resumed from {path} at step {self.step}"
                  + (f" (dropped {dropped} metrics records logged after it)" if dropped else ""), flush=True)

    def _save(self) -> None:
        view = self._view()
        state = {"step": self.step, "consumed_samples": self.consumed_samples,
                 "global_batch_size": self.layout.global_batch_size, "layout": reshard.layout_record(view)}
        write_universal = None
        if self.cfg.train.universal_checkpoint and not universal_checkpoint_unsupported(self.cfg, self.layout):
            tokenizer = Path(self.cfg.data.tokenizer)
            universal_state = {**state, "model": reshard.model_config_dict(self.cfg.model, self.dims),
                               "tokenizer": self.cfg.data.tokenizer, "data_seed": self.cfg.train.seed}
            write_universal = lambda tmp_dir: reshard.save_universal(  # noqa: E731
                view, tmp_dir, universal_state, self.lr_scheduler, tokenizer if tokenizer.is_dir() else None)
        checkpoint.save(self.engine, self.checkpoint_dir, self.step, state,
                        rng_state={"tp_dropout": self.model.rng.state_dict()}, write_extra=write_universal,
                        keep=self.cfg.train.keep_checkpoints)

    def _log(self, record: dict) -> None:
        if not self.is_logger:
            return
        self.metrics.append(record)
        self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _train_record(self, loss: float, lr: float, steps: int, seconds: float) -> dict:
        """One metrics.jsonl line: loss, schedule, throughput, MFU (when the peak is known), memory."""
        tokens_per_s = steps * self.tokens_per_step / seconds
        tflops = tokens_per_s * self.flops_per_token / self.layout.world_size / 1e12  # model TFLOP/s per device
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": self.last_grad_norm,
                  "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / self.layout.world_size,
                  "tflops": tflops, "consumed_samples": self.consumed_samples,
                  "consumed_tokens": self.step * self.tokens_per_step, "step_time_s": seconds / steps,
                  "memory_gb": memory_gb()}
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        if self.cfg.precision.dtype == "fp16":
            # DeepSpeed's fp16 optimizers name the current scale differently (cur_scale / loss_scale)
            scale = next((getattr(self.engine.optimizer, a) for a in ("cur_scale", "loss_scale")
                          if isinstance(getattr(self.engine.optimizer, a, None), (int, float, torch.Tensor))), None)
            record["loss_scale"] = None if scale is None else float(scale)
            record["skipped_steps"] = int(self.engine.skipped_steps)
        return record

    def _wandb_names(self) -> tuple[str, str]:
        """Default W&B (name, group): the group is the recipe's (recipes set logging.wandb.group) or
        the model's arch and size, so one model's layouts sit together; the name adds the layout."""
        c = self.cfg
        group = c.logging.wandb.group or f"{c.model.arch}-{self.num_parameters / 1e6:.0f}M"
        name = (f"{group}-tp{self.layout.tp}pp{self.layout.pp}dp{self.layout.dp}-zero{c.zero.stage}"
                f"-{c.precision.dtype}")
        return name, group

    def _summary(self) -> str:
        c = self.cfg
        return (f"megaframe: {c.model.arch} {self.num_parameters / 1e6:.2f}M params "
                f"(layers={c.model.num_layers} hidden={c.model.hidden_size} heads={c.model.num_attention_heads} "
                f"vocab={self.dims.vocab_size} padded to {self.dims.padded_vocab_size}) | "
                f"layout tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp} | zero={c.zero.stage} "
                f"offload={c.offload.optimizer}/{c.offload.param} precision={c.precision.dtype}"
                f"{f' compiled blocks={self.compiled_blocks}' if self.compiled_blocks else ''} | "
                f"batch micro={self.layout.micro_batch_size} global={self.layout.global_batch_size} "
                f"accum={self.layout.grad_accum_steps} seq={c.model.seq_length} | "
                f"train samples={len(self.data.train)} valid samples={len(self.data.valid or ())} | run dir {self.run_dir}"
                f"\n{plan_summary(self.memory_plan)}")

    def _log_model_states(self) -> None:
        """Once per process, after its first step: every rank's held model states, to rank 0 (collective).
        metrics.jsonl gets them once per run (step 1), so a resumed run's records equal an uninterrupted one's."""
        per_rank = gather_model_states(self.engine)
        self._model_states_logged = True
        if self.is_logger:
            if self.step == 1:  # metrics.jsonl only: W&B's charts take scalars, not per-rank tables
                self.metrics.append({**model_states_record(self.step, per_rank, self.memory_plan, self.layout.pp,
                                                           self.layout.tp, self.layout.dp),
                                     "consumed_samples": self.consumed_samples})
            (self.progress.write if self.progress else print)(model_states_line(per_rank, self.memory_plan))

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> None:
        """Train to train.max_steps (or train.exit_at_step), evaluating and saving on schedule."""
        t = self.cfg.train
        self._resume()
        if self.is_logger:
            print(self._summary(), flush=True)
            layout = {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp}
            wandb_config = {**dataclasses.asdict(self.cfg), "run": run_metadata(self.layout.world_size, layout)}
            self.wandb = WandbRun(self.cfg.logging.wandb, self.run_dir, wandb_config, *self._wandb_names())
            self.progress = Progress(t.max_steps, self.step, enabled=self.cfg.logging.progress_bar)
        stop_at = t.exit_at_step or t.max_steps
        if self.step == 0 and t.eval_interval:
            self._log({"step": 0, "eval_loss": self.evaluate(), "consumed_samples": 0})
        interval_loss, interval_steps, interval_time = 0.0, 0, 0.0
        while self.step < stop_at:
            start = time.perf_counter()
            loss, lr = self.train_step()
            interval_time += time.perf_counter() - start
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.step}; lower optim.lr or check the data")
            interval_loss, interval_steps = interval_loss + loss, interval_steps + 1
            if not self._model_states_logged:
                self._log_model_states()
            if self.step % t.log_interval == 0 or self.step == stop_at:
                record = self._train_record(interval_loss / interval_steps, lr, interval_steps, interval_time)
                self._log(record)
                if self.progress:
                    self.progress.update(self.step, record)
                interval_loss, interval_steps, interval_time = 0.0, 0, 0.0
            if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.max_steps):
                eval_loss = self.evaluate()
                self._log({"step": self.step, "eval_loss": eval_loss, "consumed_samples": self.consumed_samples})
                if self.progress:
                    self.progress.write(f"step {self.step}: eval_loss {eval_loss:.4f}")
            if (t.save_interval and self.step % t.save_interval == 0) or self.step == stop_at:
                self._save()

    def close(self, failed: bool = False) -> None:
        """Flush W&B and remove swap files; after a clean run, wait for every rank (avoids aborts at
        interpreter exit). After a failure there is no barrier: the other ranks may be blocked in a
        collective this rank will never join, and a barrier would turn the error into a hang."""
        if self.progress:
            self.progress.close()
        if self.wandb:
            self.wandb.finish(exit_code=1 if failed else 0)
        if self.nvme_swap:
            self.nvme_swap.remove()
        if dist.is_initialized() and not failed:
            dist.barrier()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def train(cfg: TrainConfig, layout: Layout, run_dir: Path) -> None:
    """Entry point for one rank: build everything, fit, shut down cleanly."""
    try:
        with Trainer(cfg, layout, run_dir) as trainer:
            trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
