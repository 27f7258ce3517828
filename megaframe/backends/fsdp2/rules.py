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
"""
from __future__ import annotations

from dataclasses import fields
from typing import Optional

from megaframe.config.schema import OffloadConfig, TrainConfig, ZeroConfig
from megaframe.config.validate import Layout

ALTERNATIVE = "or backend=deepspeed"


def config_problem(cfg: TrainConfig) -> Optional[str]:
    """Why backend=fsdp2 cannot run this config (None: it can)."""
    stage, off, p = cfg.zero.stage, cfg.offload, cfg.parallel
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
    if p.pp > 1:
        return (f"parallel.pp={p.pp} with backend=fsdp2: its pipeline schedules (torch.distributed.pipelining) are "
                f"not built yet; use parallel.pp=1, {ALTERNATIVE}")
    if cfg.train.native_checkpoint or not cfg.train.universal_checkpoint:
        return ("backend=fsdp2 writes layout-free checkpoints only: drop train.native_checkpoint=true and keep "
                "train.universal_checkpoint=true")
    return _deepspeed_knob(cfg)


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
    """Where a pipeline would cut (uniform: the same number of layers per stage); pp > 1 is refused
    by config_problem until the torch.distributed.pipelining schedules are built."""
    layers = len(weights)
    return tuple(round(i * layers / pp) for i in range(pp + 1))
