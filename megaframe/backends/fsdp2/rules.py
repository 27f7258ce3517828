"""FSDP2's config rules: how megaframe's zero / offload / precision keys map onto fully_shard, and
what this engine refuses. Pure config (no torch.distributed import): the CLI and the planner hand
them to config/validate.py through the plug, before anything launches.

  zero=stage3            reshard each block after its forward (ZeRO-3: parameters, gradients and
                         optimizer states sharded)
  zero=stage2            keep each block gathered from its forward to its backward (no second
                         all-gather; ZeRO-2's memory for the blocks in flight)
  zero=stage0/1          refused: FSDP2 always shards gradients (use zero=stage2)
  precision=bf16         bf16 compute, fp32 sharded master and fp32 gradient reduction
  precision=fp16         refused (no loss scaler here; use bf16)
  offload=cpu            CPUOffloadPolicy: sharded parameters, gradients and AdamW on the host
  parallel.ep            experts sharded over their expert-data-parallel ranks (their own group)
  parallel.pp            stages through torch.distributed.pipelining, parallel.pipeline_schedule
                         (1f1b, gpipe, interleaved_1f1b, zero_bubble, zbv, dualpipev) with
                         parallel.virtual_stages stages per rank; MoE blocks' router losses
                         attached to each stage's output
"""
from __future__ import annotations

from dataclasses import fields
from typing import Optional

from megaframe.config.schema import OffloadConfig, TrainConfig, ZeroConfig
from megaframe.config.validate import Layout
from megaframe.parallel.pipeline_schedules import (ONE_STAGE_PER_RANK, SCHEDULES, SPLIT_BACKWARD, V_SHAPED,
                                                   runs_micro_batches, stages_per_rank, uniform_cuts)

ALTERNATIVE = "or backend=deepspeed"


def config_problem(cfg: TrainConfig) -> Optional[str]:
    """Why backend=fsdp2 cannot run this config (None: it can)."""
    stage, off = cfg.zero.stage, cfg.offload
    if stage in (0, 1):
        return (f"zero.stage={stage} with backend=fsdp2: FSDP2 always shards gradients and optimizer states; "
                f"use zero=stage2 (blocks stay gathered until backward) or zero=stage3, {ALTERNATIVE}")
    if stage != 2 and stage != 3:
        return f"zero.stage={stage} is not a ZeRO stage; use zero=stage2 or zero=stage3"
    if cfg.precision.dtype == "fp16":
        return f"precision=fp16 with backend=fsdp2: it has no loss scaler; use precision=bf16, {ALTERNATIVE}"
    if "nvme" in (off.optimizer, off.param):
        return f"offload=nvme with backend=fsdp2: FSDP2 offloads to CPU memory only; use offload=cpu, {ALTERNATIVE}"
    if off.param == "cpu" and off.optimizer != "cpu":
        return ("offload.param=cpu with backend=fsdp2: FSDP2 offloads parameters together with the optimizer; "
                "use offload=cpu (offload.optimizer=cpu)")
    if problem := _pipeline_problem(cfg):
        return problem
    if cfg.train.native_checkpoint or not cfg.train.universal_checkpoint:
        return ("backend=fsdp2 writes layout-free checkpoints only: drop train.native_checkpoint=true and keep "
                "train.universal_checkpoint=true")
    return _deepspeed_knob(cfg)


def _pipeline_problem(cfg: TrainConfig) -> Optional[str]:
    p, layers = cfg.parallel, cfg.model.num_layers
    if p.pipeline_schedule not in SCHEDULES:
        return f"parallel.pipeline_schedule={p.pipeline_schedule!r} is not a schedule; choose one of {', '.join(SCHEDULES)}"
    if p.virtual_stages < 1:
        return f"parallel.virtual_stages={p.virtual_stages} must be >= 1 (pipeline stages per rank)"
    if p.pipeline_schedule in ONE_STAGE_PER_RANK and p.virtual_stages != 1:
        return (f"parallel.pipeline_schedule={p.pipeline_schedule} runs one stage per rank; use parallel.virtual_stages=1, "
                f"or parallel.pipeline_schedule=interleaved_1f1b for {p.virtual_stages} per rank")
    if p.pipeline_schedule in V_SHAPED and p.virtual_stages not in (1, 2):
        return (f"parallel.pipeline_schedule={p.pipeline_schedule} runs two stages per rank in a V; "
                f"use parallel.virtual_stages=2")
    if p.pp == 1:
        return None
    stages = p.pp * stages_per_rank(p.pipeline_schedule, p.virtual_stages)
    if stages > layers:
        return (f"parallel.pp={p.pp} x {stages // p.pp} stages per rank ({p.pipeline_schedule}) makes {stages} stages "
                f"for model.num_layers={layers}; each stage needs a block: lower parallel.pp or parallel.virtual_stages")
    if p.pipeline_schedule in SPLIT_BACKWARD and cfg.zero.stage == 3:
        # measured on torch 2.13: a block resharded after its forward loses the weight gradients
        # that the split backward computes later (gradient norm 2-36% off the single-rank run)
        return (f"parallel.pipeline_schedule={p.pipeline_schedule} with zero=stage3: its split backward computes "
                f"weight gradients after FSDP2 has resharded the block, and they are lost; use zero=stage2, or "
                f"parallel.pipeline_schedule=1f1b or interleaved_1f1b with zero=stage3")
    return None


def layout_problem(cfg: TrainConfig, layout: Layout) -> Optional[str]:
    """A pipeline schedule's needs on the step's micro-batch count m (torch's own checks, said
    before launch): 1f1b and the interleaved schedules need m >= p, dualpipev m >= 2p, and the
    schedules that run rounds of p micro-batches m a multiple of m // p."""
    p, m = cfg.parallel, layout.grad_accum_steps
    schedule, v = p.pipeline_schedule, p.virtual_stages
    if layout.pp == 1 or runs_micro_batches(schedule, layout.pp, v, m):
        return None
    good = next(k for k in range(m + 1, 64 * (m + layout.pp)) if runs_micro_batches(schedule, layout.pp, v, k))
    batch = good * layout.micro_batch_size * layout.dp
    return (f"parallel.pipeline_schedule={schedule} at parallel.pp={layout.pp} cannot run {m} micro-batches "
            f"per step (parallel.global_batch_size / (micro_batch_size x dp)); set parallel.global_batch_size="
            f"{batch} ({good} micro-batches)")


def _deepspeed_knob(cfg: TrainConfig) -> Optional[str]:
    """A DeepSpeed-only knob set away from its default: FSDP2 has no such setting, and silently
    ignoring what the user tuned would be a lie."""
    kept = {"zero": {"stage"}, "offload": {"optimizer", "param", "pin_memory"}}
    for group, default in (("zero", ZeroConfig()), ("offload", OffloadConfig())):
        section = getattr(cfg, group)
        for f in fields(default):
            if f.name not in kept[group] and getattr(section, f.name) != getattr(default, f.name):
                return (f"{group}.{f.name}={getattr(section, f.name)} is a DeepSpeed setting backend=fsdp2 does not "
                        f"have; drop it, {ALTERNATIVE}")
    return None


def config_warnings(cfg: TrainConfig, layout: Layout) -> list[str]:
    return []  # what it cannot do, it refuses


def expert_parallel_problem(zero_stage: int, ep: int) -> Optional[str]:
    return None  # experts shard over their expert-data-parallel ranks at either stage


def system_problem(offload: OffloadConfig, swap_bytes: float) -> Optional[str]:
    return None  # no JIT-built op, no swap folder: CPU offload is torch's own


def stage_boundaries(weights: tuple, pp: int) -> tuple:
    """Where a layer list is cut into pp parts as evenly as whole layers allow (the dry run's check;
    pipeline.py block_ranges cuts FSDP2's blocks, the embedding on the first stage and the final norm
    and head on the last)."""
    return tuple(uniform_cuts(len(weights), pp))
