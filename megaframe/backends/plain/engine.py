"""PlainBackend: one process, megaframe's GPT stepped by torch's fused AdamW, no engine library.

It stands in for DeepSpeed's engine where that engine would do nothing but call the same torch code
(registry.run_engine decides): ZeRO-0, fp32, no offload, one process. The step is DeepSpeed's as
DeepSpeedBackend drives it there, operation for operation, so the numbers are the same bits:
- each micro-batch's loss divided by the number of micro-batches before its backward (DeepSpeed's
  scaling by gradient accumulation steps);
- megaframe's gradient norm in fp64, a non-finite norm or skip_if skipping the update (and the LR
  schedule), clipping by clip / (norm + 1e-6);
- torch's AdamW with fused=True on the same two parameter groups, then the LR schedule, then the
  gradients freed.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megaframe.backends import Batch, StepResult
from megaframe.backends.common import (apply_update, counting_targets, dp_mean, eval_mean, held_model_states,
                                       join_torch_world, model_state_parts, on_device, router_metrics,
                                       step_targets_of)
from megaframe.backends.plain import state_io
from megaframe.checkpoint.staging import HostStaging
from megaframe.checkpoint.universal import CheckpointError
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout
from megaframe.model.dims import GPTDims
from megaframe.model.factory import build_model, compile_model, count_parameters
from megaframe.model.moe import update_expert_biases
from megaframe.optim.build import build_optimizer
from megaframe.parallel.grad_norm import grad_norm
from megaframe.parallel.fp8 import recipe_for
from megaframe.parallel.state import ParallelState


def device_type() -> str:
    """DeepSpeed's choice, made without importing it: DS_ACCELERATOR=cpu keeps the run on the host
    (registry.run_engine leaves any other accelerator name to DeepSpeed), else the GPU torch sees."""
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def init_distributed(collective_timeout_s: Optional[float] = None, join_timeout_s: Optional[float] = None) -> None:
    """A world of one (ParallelState's groups need one), joined as FSDP2 joins its world: the device
    first, then torchrun's restart prefix (a one-rank elastic attempt), else a plain init."""
    join_torch_world(device_type(), collective_timeout_s, join_timeout_s)


class PlainBackend:
    """The one process's model and optimizer (backends/__init__.py's Backend)."""

    writes_layout_free = True

    def __init__(self, cfg: TrainConfig, layout: Layout, ps: ParallelState, dims: GPTDims,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any]):
        self.cfg, self.layout, self.ps, self.dims = cfg, layout, ps, dims
        self.device = torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" \
            else torch.device("cpu")
        p = cfg.parallel
        module = build_model(dims, ps, cfg.train.seed, p.activation_checkpointing, p.sequence_parallel,
                             cp_impl=p.cp_impl, matmul=recipe_for(cfg.precision, dims.num_layers, device_type()))
        self.compiled_blocks = compile_model(module, cfg.train.compile_scope) if cfg.train.compile else 0
        self.module = module.to(self.device)
        self.step_targets = step_targets_of(module.step_targets, dims)
        self.num_parameters = count_parameters(module, full=True)
        # DeepSpeed's ZeRO-0 optimizer as ds_config.py asks for it (torch's fused AdamW), or optim=muon
        self.optimizer = build_optimizer(self.module, cfg.optim, fused=True)
        self.lr_scheduler = lr_scheduler(self.optimizer)
        self.parameters = list(self.module.parameters())
        self._last_grad_norm = float("nan")

    # ---- steps -------------------------------------------------------------------------------
    def train_step(self, batches: list[Batch], skip_if: Optional[Callable[[float], bool]] = None) -> StepResult:
        total: Optional[torch.Tensor] = None  # the losses add up on the device: one host read per step
        on_it = on_device(batches, self.device)
        with counting_targets(self.step_targets, on_it, self.ps):
            for inputs, targets in on_it:
                loss = self.module(inputs, targets)
                (loss / len(batches)).backward()
                detached = loss.detach().to(torch.float64)
                total = detached if total is None else total + detached
        mean = dp_mean(total / len(batches), self.ps)
        norm = grad_norm(self.module, self.ps, parameters=self.parameters)
        self._last_grad_norm = norm
        applied = math.isfinite(norm) and not (skip_if is not None and skip_if(mean))
        apply_update(self.optimizer, self.lr_scheduler, self.parameters, norm, self.cfg.optim.grad_clip, applied)
        # MoE bias balancing: a skipped step's routing moves no bias
        update_expert_biases(getattr(self.module, "moe_layers", []), self.dims.num_moe_blocks, self.dims.moe,
                             self.device, apply=applied)
        return StepResult(loss=mean, applied=applied)

    def eval_step(self, batches: list[Batch]) -> float:
        return eval_mean(self.module, batches, self.device, self.ps, self.step_targets)

    def grad_norm(self) -> float:
        return float(self._last_grad_norm)

    def lr(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    def precision_state(self) -> dict[str, Any]:
        return {}  # fp32 only: no loss scale

    def router_metrics(self) -> dict[str, float]:
        return router_metrics(self.module, self.ps, self.dims, self.device)

    def held_model_states(self) -> dict[str, int]:
        return held_model_states(self.parameters, self.optimizer)

    def hook_forward(self, hook) -> torch.utils.hooks.RemovableHandle:
        return self.module.register_forward_hook(hook)

    # ---- state -------------------------------------------------------------------------------
    def state_parts(self) -> dict[str, Any]:
        return model_state_parts(self.module, self.ps, self.dims, self.device)

    def layout_record(self) -> dict[str, Any]:
        # DeepSpeed's record of the same layout: a checkpoint either engine wrote brings the RNG back
        return {**self.layout.grid.layout_record(), "zero_stage": self.cfg.zero.stage,
                "dtype": self.cfg.precision.dtype}

    def save_native(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        raise NotImplementedError("the plain engine writes layout-free checkpoints only: registry.run_engine "
                                  "leaves train.native_checkpoint and train.universal_checkpoint=false to DeepSpeed")

    def load_native(self, directory: Path, tag: str) -> dict[str, Any]:
        raise CheckpointError(f"train.resume: {Path(directory) / tag} holds only DeepSpeed's own files; resume it with "
                              f"backend.plain_one_process=false (DeepSpeed's engine reads them)")

    def has_native(self, path: Path) -> bool:
        return any(Path(path).glob("*model_states.pt"))

    def save_full_state(self, directory: Path, state: dict[str, Any], tokenizer_dir: Optional[Path],
                        staging: Optional[HostStaging] = None):
        return state_io.save(self._view(), directory, state, tokenizer_dir, staging)

    def load_full_state(self, directory: Path) -> dict[str, Any]:
        return state_io.resume(self._view(), directory)

    def _view(self) -> state_io.PlainView:
        return state_io.PlainView(self.module, self.optimizer, self.lr_scheduler, self.dims, self.layout_record())

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def close(self) -> None:
        pass  # nothing outside memory
