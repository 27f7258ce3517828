"""Fsdp2Backend: megaframe's GPT sharded with torch's fully_shard and stepped by torch's AdamW.

zero=stage3 reshards each block after its forward (gathered again for backward), zero=stage2 keeps
it gathered until its backward; gradients are reduce-scattered after every micro-batch's backward
(each rank keeps only its shard: no whole-model gradient between micro-batches). The step itself is
plain torch: megaframe's shard-aware gradient norm, clipping, AdamW on the local shards, the LR
schedule advancing only on applied steps (as DeepSpeed's does).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megaframe.backends import Batch, StepResult
from megaframe.backends.common import (apply_update, counting_targets, dp_mean, eval_mean, join_torch_world,
                                       on_device, model_state_parts, pinned_offload, router_metrics, step_targets_of)
from megaframe.backends.fsdp2 import build, pipeline, state_io
from megaframe.backends.fsdp2.mesh import data_mesh
from megaframe.checkpoint.staging import HostStaging
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout
from megaframe.model.dims import GPTDims
from megaframe.model.factory import build_model, compile_blocks, count_parameters
from megaframe.model.moe import update_expert_biases
from megaframe.optim.build import build_optimizer
from megaframe.parallel.grad_norm import grad_norm
from megaframe.parallel.fp8 import recipe_for
from megaframe.parallel.state import ParallelState


def device_type() -> str:
    """Where this rank trains: the GPU when torch sees one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(collective_timeout_s: Optional[float] = None, join_timeout_s: Optional[float] = None) -> None:
    """This rank's device, then the launcher's process group or a world of one."""
    join_torch_world(device_type(), collective_timeout_s, join_timeout_s)


def device_supports_fp16() -> bool:
    return False  # refused by the rules before this is asked: FSDP2 here trains fp32 or bf16


def device_supports_bf16() -> bool:
    """bf16 natively: CUDA from sm80 (Ampere) on; on the CPU, what torch says."""
    if torch.cuda.is_available() and torch.version.hip is None:
        return torch.cuda.get_device_capability()[0] >= 8
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available()


class Fsdp2Backend:
    """One rank's model under FSDP2 (backends/__init__.py's Backend)."""

    compiled_blocks = 0
    writes_layout_free = True

    def __init__(self, cfg: TrainConfig, layout: Layout, ps: ParallelState, dims: GPTDims,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any]):
        p = cfg.parallel
        self.cfg, self.layout, self.ps, self.dims = cfg, layout, ps, dims
        offload = cfg.offload.optimizer == "cpu"  # CPUOffloadPolicy: parameters, gradients, AdamW
        self.device = torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" \
            else torch.device("cpu")
        # the data-parallel ranks (dp x cp: cp ranks hold replicas of the weights too) as FSDP's mesh;
        # experts split over ep ranks shard over their expert-data-parallel ranks instead
        data = data_mesh(ps, device_type())
        self.mesh, self.shard_group, self.replica = data.mesh, data.shard_group, data.replica
        self.replicated = ps.grid.dp_replicate > 1
        # no replicated-gradient bucket: FSDP2 reduces each gradient as its backward ends, and a
        # bucket summed at the step's end would miss it (TP-replicated gradients sum at each use)
        pipelined = layout.grid.pp > 1
        with build.parameters_on_meta():
            module = build_model(dims, ps, cfg.train.seed, p.activation_checkpointing, p.sequence_parallel,
                                 grad_bucket=None, cp_impl=p.cp_impl, initialise=False,
                                 matmul=recipe_for(cfg.precision, dims.num_layers, device_type()))
            # pipelined: this rank's stages of the model built whole on meta (the rest is dropped)
            stages = pipeline.cut_stages(module, ps, p.pipeline_schedule, p.virtual_stages, p.pipeline_partition) \
                if pipelined else {}
        self.num_parameters = count_parameters(module, full=True)
        marks = build.parameter_marks(module)
        parts = list(stages.values()) if pipelined else [module]
        self.compiled_blocks = sum(compile_blocks(part) for part in parts) if cfg.train.compile else 0
        self.expert_shard_group = ps.group("edp") if layout.grid.ep > 1 else None
        experts = build.ExpertSharding(
            DeviceMesh.from_group(self.expert_shard_group, device_type(), mesh_dim_names=("edp_shard",)),
            divide_by=layout.grid.size("dp", "cp"),
            # gloo has no pre-multiplied sum; at one edp rank nothing is reduced, and torch 2.13's
            # single-rank path would divide a force-summed gradient twice
            force_sum=dist.get_backend() == "gloo" and layout.grid.edp > 1) \
            if self.expert_shard_group is not None else None
        for part in parts:  # each pipeline stage is sharded as the whole model is without pipelining
            policies = build.policies(cfg.precision.dtype, offload, pinned_offload(cfg.offload.pin_memory, self.device))
            build.shard_model(part, self.mesh, reshard_after_forward=cfg.zero.stage == 3, experts=experts, **policies)
            build.materialise(part, torch.device("cpu") if offload else self.device, self.device, dims,
                              cfg.train.seed, marks)
        self.pipeline: Optional[pipeline.Pipeline] = None
        self.tied_copies: frozenset[int] = frozenset()
        if pipelined:
            self.module = pipeline.RankStages(parts)
            self.tied_copies = frozenset(id(param) for param in pipeline.tied_copies(stages))
            self.pipeline = pipeline.build_pipeline(
                stages, module, ps, p.pipeline_schedule, layout.grad_accum_steps, layout.micro_batch_size,
                p.sequence_parallel, build.compute_dtype(cfg.precision.dtype), self.device,
                pipeline.embedding_groups(ps, p.pipeline_schedule, dims.tie_embeddings))
        else:
            self.module = module
        self.parameters = list(self.module.parameters())  # listed once: the norm and the update ask every step
        # the whole model's, which the pipeline's loss function reads too (pipeline.loss_function)
        self.step_targets = step_targets_of(module.step_targets, dims)
        # fused where the shards live on the GPU; on the host torch's fused CPU kernel, which DeepSpeed's
        # ZeRO-0 uses too
        self.optimizer = build_optimizer(self.module, cfg.optim, fused=True, ps=ps)
        self.lr_scheduler = lr_scheduler(self.optimizer)
        self._last_grad_norm = float("nan")

    # ---- steps -------------------------------------------------------------------------------
    def train_step(self, batches: list[Batch], skip_if: Optional[Callable[[float], bool]] = None) -> StepResult:
        on_it = on_device(batches, self.device)
        if self.pipeline is not None:
            with counting_targets(self.step_targets, on_it, self.ps):  # the schedule cuts the batch into them again
                total = self.pipeline.train(torch.cat([b[0] for b in on_it]), torch.cat([b[1] for b in on_it]))
            loss = dp_mean(total / len(batches), self.ps)  # one host read per step
            self.pipeline.sum_tied_gradients()
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            with counting_targets(self.step_targets, on_it, self.ps):
                for i, (inputs, targets) in enumerate(on_it):
                    if self.replicated:  # HSDP: across the replicas once per step, after the last micro-batch
                        self.module.set_requires_all_reduce(i == len(batches) - 1)
                    loss = self.module(inputs, targets)
                    # FSDP2 reduce-scatters each block's gradient as its backward ends
                    (loss / len(batches)).backward()
                    total += loss.detach()
            loss = dp_mean(total / len(batches), self.ps)  # one host read per step
        norm = grad_norm(self.module, self.ps, counted_elsewhere=lambda param: id(param) in self.tied_copies,
                         shard_group=self.shard_group, expert_shard_group=self.expert_shard_group,
                         collective_device=self.device, parameters=self.parameters)
        self._last_grad_norm = norm
        applied = math.isfinite(norm) and not (skip_if is not None and skip_if(loss))
        # gradients freed after: a step's first reduce-scatter then assigns its gradient instead of adding
        # to a zero one (which, offloaded, would be a blocking copy to the host per group and micro-batch)
        apply_update(self.optimizer, self.lr_scheduler, self.parameters, norm, self.cfg.optim.grad_clip, applied)
        # MoE bias balancing: a skipped step's routing moves no bias
        update_expert_biases(getattr(self.module, "moe_layers", []), self.dims.num_moe_blocks, self.dims.moe,
                             self.device, apply=applied)
        return StepResult(loss=loss, applied=applied)

    @torch.no_grad()
    def eval_step(self, batches: list[Batch]) -> float:
        if self.pipeline is None:
            mean = eval_mean(self.module, batches, self.device, self.ps, self.step_targets)
        else:
            self.module.eval()
            on_it = on_device(batches, self.device)
            with counting_targets(self.step_targets, on_it, self.ps):
                total = self.pipeline.evaluate(on_it)
            self.module.train()
            mean = dp_mean(total / len(batches), self.ps)
        build.reshard(self.module)  # a forward without backward leaves the root gathered
        return mean

    def grad_norm(self) -> float:
        return float(self._last_grad_norm)

    def lr(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    def precision_state(self) -> dict[str, Any]:
        return {}  # no fp16 here: no loss scale

    def router_metrics(self) -> dict[str, float]:
        return router_metrics(self.module, self.ps, self.dims, self.device)

    def held_model_states(self) -> dict[str, int]:
        return state_io.held_model_states(self.module, self.optimizer)

    def hook_forward(self, hook) -> torch.utils.hooks.RemovableHandle:
        return self.module.register_forward_hook(hook)

    # ---- state -------------------------------------------------------------------------------
    def state_parts(self) -> dict[str, Any]:
        return model_state_parts(self.module, self.ps, self.dims, self.device)

    def layout_record(self) -> dict[str, Any]:
        return state_io.layout_record(self.ps, self.cfg)

    def save_native(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        raise NotImplementedError("backend=fsdp2 writes layout-free checkpoints only (refused before launch: "
                                  "train.native_checkpoint / train.universal_checkpoint)")

    def load_native(self, directory: Path, tag: str) -> dict[str, Any]:
        raise NotImplementedError("backend=fsdp2 has no native checkpoint files: it resumes from layout-free ones")

    def has_native(self, path: Path) -> bool:
        return False

    def save_full_state(self, directory: Path, state: dict[str, Any], tokenizer_dir: Optional[Path],
                        staging: Optional[HostStaging] = None):
        return state_io.save(self._view(), directory, state, tokenizer_dir, staging)

    def load_full_state(self, directory: Path) -> dict[str, Any]:
        return state_io.resume(self._view(), directory)

    def _view(self) -> state_io.ShardView:
        return state_io.ShardView(self.module, self.optimizer, self.lr_scheduler, self.ps, self.dims, self.cfg,
                                  self.replica, self.tied_copies)

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def close(self) -> None:
        pass  # nothing outside memory: no swap files, no JIT-built ops
