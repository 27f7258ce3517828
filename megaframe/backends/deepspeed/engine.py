"""DeepSpeedBackend: the model built, wrapped in a DeepSpeed engine and driven one step at a time.

ZeRO, offload, precision, gradient accumulation and the pipeline schedule are DeepSpeed's; this
class turns the typed config into its JSON (ds_config.py), builds the model or its pipeline stage,
and answers the trainer's Backend calls (megaframe/backends/__init__.py).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megaframe.backends import Batch, StepResult
from megaframe.backends.common import (counting_targets, dp_mean, local_device_index, on_device, pinned_offload,
                                       process_group_defaults, model_state_parts, restore_schedule, router_metrics,
                                       step_targets_of, to_device)
from megaframe.backends.deepspeed import state_io
from megaframe.backends.deepspeed.build_locks import load_ops, ops_for
from megaframe.backends.deepspeed.build_step import undo_build_step
from megaframe.backends.deepspeed.ds_config import to_ds_config
from megaframe.backends.deepspeed.experts import deepspeed_expert_marks, mark_expert_parallel
from megaframe.backends.deepspeed.memory import held_model_states
from megaframe.backends.deepspeed.muon_import import import_muon_lazily
from megaframe.backends.deepspeed.muon_zero import describe_partitions
from megaframe.backends.deepspeed.nvme import open_nvme_swap
from megaframe.backends.deepspeed.plug import replicated_grad_bucket
from megaframe.backends.deepspeed.pipeline import build_pipeline_model, counted_on_another_stage
from megaframe.backends.deepspeed.overflow import batch_overflow_check
from megaframe.backends.deepspeed.rules import layout_free_unsupported
from megaframe.backends.deepspeed.skip_gate import LastMicroBatchGate, gate_plain_optimizer
from megaframe.backends.deepspeed.topology import MegatronMpu
from megaframe.backends.deepspeed.zero_init import (built_shape, builds_partitioned, gathered_numel,
                                                    partitioned_construction, write_partition)
from megaframe.checkpoint.staging import HostStaging
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout
from megaframe.model.dims import GPTDims
from megaframe.model.factory import build_model, compile_model, count_parameters
from megaframe.model.moe import update_expert_biases
from megaframe.optim.build import build_optimizer, param_groups
from megaframe.optim.state import state_keys_by_param
from megaframe.parallel.rendezvous import join_world
from megaframe.parallel.grad_bucket import ReplicatedGradBucket
from megaframe.parallel.grad_norm import grad_norm
from megaframe.parallel.fp8 import recipe_for
from megaframe.parallel.state import ParallelState


def init_distributed(collective_timeout_s: Optional[float] = None, join_timeout_s: Optional[float] = None) -> None:
    """Set this rank's device, join the launcher's process group (or make a world of one when
    there is no launcher) and register it with deepspeed.comm, which PipelineModule needs before
    deepspeed.initialize.

    The device comes first: a collective issued before it (NCCL's communicator, a broadcast of
    the run directory) would otherwise put every rank of the node on device 0."""
    timeout = process_group_defaults(collective_timeout_s)
    device = local_device_index(int(os.environ.get("LOCAL_RANK", "0")), get_accelerator().device_count())
    get_accelerator().set_device(device)  # a no-op on the CPU
    # every rank awaited within join_timeout_s, a torchrun restart under its attempt's prefix (rendezvous.py)
    join_world(get_accelerator().communication_backend_name(), timeout, join_timeout_s)
    if get_accelerator().device_name() != "cpu":
        # DeepSpeed takes LOCAL_RANK for the device ordinal (the engine's set_device, zero.Init's
        # device, PipelineModule's .to): local rank 3 that sees one device (SLURM --gpus-per-task,
        # Ray) failed with "invalid device ordinal". After the join, whose one line per node reads it.
        os.environ["LOCAL_RANK"] = str(device)
    if get_accelerator().device_name() == "cpu":
        # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op here (45 s on first use)
        # that only its inference path calls; training collectives go through torch.distributed.
        # DeepSpeed keeps edits to this dict (deepspeed/ops/__init__.py).
        # imported under its own name: `import deepspeed.ops` here would make `deepspeed` a local
        # of this whole function, unbound on every other accelerator (UnboundLocalError on CUDA)
        from deepspeed import ops as deepspeed_ops

        deepspeed_ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=timeout)


class DeepSpeedBackend:
    """One rank's model inside a DeepSpeed engine (a PipelineEngine when pp > 1)."""

    def __init__(self, cfg: TrainConfig, layout: Layout, ps: ParallelState, dims: GPTDims,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any]):
        self.cfg, self.layout, self.ps, self.dims = cfg, layout, ps, dims
        self.device = torch.device(get_accelerator().current_device_name())
        p = cfg.parallel
        self.pipelined = layout.pp > 1
        self.grad_bucket = self._replicated_grad_bucket()
        self.nvme_swap = open_nvme_swap(cfg.offload)
        load_ops(ops_for(cfg.offload))  # before initialize, whose collectives must not wait on a JIT build
        import_muon_lazily()  # ZeRO and bf16 import it; eagerly it costs each rank ~1.9 CPU-s (muon_import.py)
        ds_config = to_ds_config(cfg, layout, swap_dir=str(self.nvme_swap.path) if self.nvme_swap else None,
                                 pin_memory=pinned_offload(cfg.offload.pin_memory, self.device))
        self.built_partitioned = builds_partitioned(cfg.zero.stage, cfg.offload.param, self.pipelined)
        matmul = recipe_for(cfg.precision, dims.num_layers, self.device.type)  # fp8's, or the default
        if self.pipelined:
            module = build_pipeline_model(dims, ps, cfg.train.seed, p.pipeline_partition,
                                          p.activation_checkpointing, p.sequence_parallel, grad_bucket=self.grad_bucket,
                                          cp_impl=p.cp_impl, accumulation_steps=layout.grad_accum_steps, matmul=matmul)
        elif self.built_partitioned:  # ZeRO-3: no rank builds the whole model (zero_init.py)
            with partitioned_construction(ds_config, ps):
                module = build_model(dims, ps, cfg.train.seed, p.activation_checkpointing, p.sequence_parallel,
                                     grad_bucket=self.grad_bucket, write_init=write_partition, cp_impl=p.cp_impl,
                                     built_shape=built_shape, expert_marks=deepspeed_expert_marks, matmul=matmul)
        else:
            module = build_model(dims, ps, cfg.train.seed, p.activation_checkpointing, p.sequence_parallel,
                                 grad_bucket=self.grad_bucket, cp_impl=p.cp_impl, expert_marks=deepspeed_expert_marks,
                                 matmul=matmul)
        mark_expert_parallel(module, ps, cfg.zero.stage)
        self.compiled_blocks = compile_model(module, cfg.train.compile_scope) if cfg.train.compile else 0
        self.module = module
        # the pipeline's loss function weighs the last stage's losses (no other stage computes one, so
        # none counts targets); the model itself elsewhere
        self.step_targets = None if self.pipelined and not ps.is_last_stage else \
            step_targets_of(module.loss_fn.step_targets if self.pipelined else module.step_targets, dims)
        self.num_parameters = self._count_parameters(module)
        self.writes_layout_free = not layout_free_unsupported(cfg, layout)
        # Muon: megaframe's, as ZeRO's client optimizer (muon_zero.py); AdamW: DeepSpeed's, from ds_config
        client = (build_optimizer(module, cfg.optim, ps=ps, shape=built_shape, described=True,
                                  split_groups=_expert_groups_split(module)) if cfg.optim.name == "muon" else None)
        # each parameter's state names, read before ZeRO puts its flat partitions in the groups
        self._state_keys = state_keys_by_param(client) if client is not None else None
        self.engine, _, _, self.lr_scheduler = deepspeed.initialize(
            model=module, optimizer=client,
            model_parameters=None if client else param_groups(module, cfg.optim, built_shape),
            config=ds_config, lr_scheduler=lr_scheduler,
            mpu=None if self.pipelined else MegatronMpu(ps))  # a PipelineModule brings its own grid
        if client is not None:
            describe_partitions(self.engine.optimizer, client)
        if self.grad_bucket is not None:
            self._flush_bucket_at_boundary()
        undo_build_step(self.engine.optimizer)  # its fp16/bf16 ZeRO-0 optimizer steps once at build (build_step.py)
        batch_overflow_check(self.engine.optimizer)  # bf16/fp16 at ZeRO-0: one host read, not one per tensor
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if hasattr(scaler, "raise_error_at_min_scale"):
            # at the minimum fp16 scale DeepSpeed ended the run with a bare Exception on an overflow, and
            # on the guard's own skip of a spike; training/step_guard.py ends a run that keeps
            # overflowing there after train.max_consecutive_skips, in one line with exit 3
            scaler.raise_error_at_min_scale = False
        self._last_grad_norm = float("nan")
        self._norm_from_grads = cfg.zero.stage == 0 and cfg.precision.dtype == "fp32"
        if self._norm_from_grads:
            self._measure_and_clip_in_step()
        if self._norm_from_grads and not self.pipelined and layout.grid.size("dp", "cp") == 1:
            # one replica (cp ranks are replicas too): DeepSpeed would still flatten, all-reduce (over a group of one) and copy
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
        parameters = list(self.engine.module.parameters())  # fixed from here on (ZeRO-0 keeps the module's own)

        def measure_clip_step(*args, **kwargs):
            self._last_grad_norm = grad_norm(self.engine.module, self.ps, counted_on_another_stage,
                                             parameters=parameters)
            gate_plain_optimizer(self.engine.optimizer, self._last_grad_norm)  # non-finite: no update
            if clip > 0 and self._last_grad_norm > clip:
                scale = clip / (self._last_grad_norm + 1e-6)
                torch._foreach_mul_([p.grad for p in parameters if p.grad is not None], scale)
            return take_model_step(*args, **kwargs)
        self.engine._take_model_step = measure_clip_step

    def _replicated_grad_bucket(self) -> Optional[ReplicatedGradBucket]:
        """One bucket for the TP-replicated parameters' gradients (parallel/grad_bucket.py), where
        DeepSpeed leaves them in .grad until the accumulation boundary (plug.py says where: the
        planner counts the bucket from the same answer)."""
        if self.layout.tp == 1 or not replicated_grad_bucket(self.cfg.zero.stage, self.pipelined,
                                                             self.cfg.precision.dtype):
            return None
        return ReplicatedGradBucket(self.ps.tp_group)

    def _flush_bucket_at_boundary(self) -> None:
        """Sum the bucket before DeepSpeed reads gradients: at the end of the step's last backward
        pass (the engine knows which), or, in the pipeline, when its schedule reduces gradients."""
        bucket = self.grad_bucket
        if not self.pipelined:
            bucket.is_boundary = self.engine.is_gradient_accumulation_boundary
            return
        bucket.is_boundary = lambda: False  # the pipeline marks its boundary only after every backward
        reduce = self.engine.allreduce_gradients

        def flush_then_reduce(*args, **kwargs):
            bucket.flush()
            return reduce(*args, **kwargs)
        self.engine.allreduce_gradients = flush_then_reduce

    def _count_parameters(self, module: torch.nn.Module) -> int:
        """The whole model's parameters: TP shards at full size, pipeline stages summed."""
        local = sum(count_parameters(m, full=True, numel=gathered_numel) for m in module.children()
                    if not (self.pipelined and m is getattr(module, "tied_modules", None) and not self.ps.is_first_stage))
        if self.pipelined and self.ps.pp > 1:
            total = torch.tensor([local], dtype=torch.int64, device=self.device)
            dist.all_reduce(total, group=self.ps.pp_group)
            return int(total.item())
        return local

    def _fed(self, batches: list[Batch]) -> list[Batch]:
        """The micro-batches as the engine takes them: on the device. DeepSpeed's pipeline loads the
        inputs on the first stage and the targets on the last itself, by a plain .to(device) of each
        micro-batch as its schedule reaches it: from ordinary host memory that copy waits for the
        stream on a GPU, once per micro-batch. So those stages get theirs here, all at once and
        asynchronously from pinned memory (DeepSpeed's copy is then a device clone), and the other
        stages nothing they would not read."""
        if not self.pipelined:
            return on_device(batches, self.device)
        first, last = self.ps.is_first_stage, self.ps.is_last_stage
        return [(to_device(inputs, self.device) if first else inputs,
                 to_device(targets, self.device) if last else targets) for inputs, targets in batches]

    def _dp_mean(self, value: torch.Tensor) -> float:
        return dp_mean(value, self.ps)

    # ---- steps -------------------------------------------------------------------------------
    def train_step(self, batches: list[Batch], skip_if: Optional[Callable[[float], bool]] = None) -> StepResult:
        # losses add up on the device: the host reads the step's mean once, not per micro-batch
        gate = LastMicroBatchGate(len(batches), self._dp_mean, skip_if)
        # fp16: a skip the guard asks for must not count as an overflow (a few Python numbers, no device read)
        scaler = state_io.loss_scaler_state(self.engine.optimizer) \
            if skip_if is not None and self.cfg.precision.dtype == "fp16" else {}
        on_it = self._fed(batches)
        if self.pipelined:  # the engine runs the micro-batches through its 1F1B schedule
            self.module.loss_fn.gate = gate if skip_if else None  # the last stage's loss_fn sees every loss
            try:
                with counting_targets(self.step_targets, on_it, self.ps):
                    loss = float(self.engine.train_batch(data_iter=iter(on_it)))  # already averaged over DP
            finally:
                self.module.loss_fn.gate = None
        else:
            with counting_targets(self.step_targets, on_it, self.ps):
                for inputs, targets in on_it:
                    self.engine.backward(gate(self.engine(inputs, targets)))
                    self.engine.step()
            loss = gate.mean()
        applied = bool(self.engine.was_step_applied())
        if scaler and not applied and math.isfinite(loss) and skip_if(loss):
            # the guard's skip poisoned the gradients, and DeepSpeed's scaler took the NaN for an overflow
            # (halving the scale, or using up hysteresis): every rank decides alike, from the global loss
            state_io.restore_loss_scaler(self.engine.optimizer, scaler)
        # MoE bias balancing: a skipped step's routing moves no bias
        update_expert_biases(getattr(self.module, "moe_layers", []), self.dims.num_moe_blocks, self.dims.moe,
                             self.device, apply=applied)
        if not self._norm_from_grads:
            # kept as DeepSpeed returns it (a device tensor under ZeRO): read on the host at log steps only
            self._last_grad_norm = self.engine.get_global_grad_norm()
        return StepResult(loss=loss, applied=applied)

    @torch.no_grad()
    def eval_step(self, batches: list[Batch]) -> float:
        self.engine.eval()
        on_it = self._fed(batches)
        if self.pipelined:
            with counting_targets(self.step_targets, on_it, self.ps):
                mean = float(self.engine.eval_batch(iter(on_it), num_micro_batches=len(batches)))
            self.engine.train()
            return mean
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with counting_targets(self.step_targets, on_it, self.ps):
            for inputs, targets in on_it:
                total += self.engine(inputs, targets).detach()
        self.engine.train()
        return self._dp_mean(total / len(batches))

    def grad_norm(self) -> float:
        return float(self._last_grad_norm)

    def lr(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    def precision_state(self) -> dict[str, Any]:
        if self.cfg.precision.dtype != "fp16":
            return {}
        # DeepSpeed's fp16 optimizers name the current scale differently (cur_scale / loss_scale)
        scale = next((getattr(self.engine.optimizer, a) for a in ("cur_scale", "loss_scale")
                      if isinstance(getattr(self.engine.optimizer, a, None), (int, float, torch.Tensor))), None)
        return {"loss_scale": None if scale is None else float(scale)}

    def router_metrics(self) -> dict[str, float]:
        return router_metrics(self.module, self.ps, self.dims, self.device)

    def held_model_states(self) -> dict[str, int]:
        return held_model_states(self.engine)

    def hook_forward(self, hook) -> torch.utils.hooks.RemovableHandle:
        return self.module.register_forward_hook(hook)

    # ---- state -------------------------------------------------------------------------------
    def _view(self) -> state_io.EngineView:
        return state_io.EngineView(self.engine, self.ps, self.dims, self.pipelined, self.cfg.zero.stage,
                                   self.cfg.precision.dtype, self.cfg.optim.name, self._state_keys)

    def state_parts(self) -> dict[str, Any]:
        return model_state_parts(self.module, self.ps, self.dims, self.device)

    def layout_record(self) -> dict[str, Any]:
        return state_io.layout_record(self._view())

    def save_native(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)

    def load_native(self, directory: Path, tag: str) -> dict[str, Any]:
        # DeepSpeed's load puts the saved schedule back whole (LambdaLR.load_state_dict: its factors'
        # max_steps, warmup and decay, and the base lrs), where this run's config decides the schedule
        # from the saved step on, as a layout-free resume does and the resume's change line says
        sched = self.lr_scheduler
        configured = list(sched.base_lrs), [dict(vars(factor)) for factor in sched.lr_lambdas]
        with torch.no_grad():  # a pipeline's load broadcasts its tied weights again (pipeline.py says why no grad)
            loaded, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if loaded is None:
            raise RuntimeError(f"train.resume: DeepSpeed could not load a checkpoint from {Path(directory) / tag}")
        sched.base_lrs = configured[0]
        for factor, fields in zip(sched.lr_lambdas, configured[1]):
            vars(factor).update(fields)
        restore_schedule(sched, sched.last_epoch)
        return client_state

    def has_native(self, path: Path) -> bool:
        return any(Path(path).glob("*model_states.pt"))

    def save_full_state(self, directory: Path, state: dict[str, Any], tokenizer_dir: Optional[Path],
                        staging: Optional[HostStaging] = None) -> Optional[Callable[[], None]]:
        return state_io.save_universal(self._view(), directory, state, self.lr_scheduler, tokenizer_dir, staging)

    def load_full_state(self, directory: Path) -> dict[str, Any]:
        return state_io.resume_universal(self._view(), directory, self.lr_scheduler)

    def versions(self) -> dict[str, str]:
        return {"deepspeed": deepspeed.__version__}

    def close(self) -> None:
        if self.nvme_swap:
            self.nvme_swap.remove()


def _expert_groups_split(module):
    """What DeepSpeed does to its own optimizer's groups of a model with experts (ZeRO-1/2 assert a
    client optimizer's groups were cut so): each group's experts in a group of their own ("moe",
    named by their expert-data-parallel group), which ZeRO partitions over those ranks. None
    without experts."""
    from deepspeed.moe.utils import has_moe_layers, split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer if has_moe_layers(module)[0] else None
