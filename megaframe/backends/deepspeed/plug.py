"""DeepSpeed as megaframe's registry sees it (backends/registry.py). Every entry imports its module
when called: importing this file imports no DeepSpeed."""
from __future__ import annotations

from typing import Any, Optional

from megaframe.backends.registry import EnginePlug
from megaframe.config.schema import OffloadConfig


def build(*args: Any, **kwargs: Any):
    from megaframe.backends.deepspeed.engine import DeepSpeedBackend

    return DeepSpeedBackend(*args, **kwargs)


def init_distributed(collective_timeout_s: Optional[float] = None) -> None:
    from megaframe.backends.deepspeed.engine import init_distributed as init

    init(collective_timeout_s)


def device_supports_fp16() -> bool:
    from megaframe.backends.deepspeed.accelerator import device_supports_fp16 as ask

    return ask()


def device_supports_bf16() -> bool:
    from megaframe.backends.deepspeed.accelerator import device_supports_bf16 as ask

    return ask()


def system_problem(offload: OffloadConfig, swap_bytes: float) -> Optional[str]:
    from megaframe.backends.deepspeed.system import system_problem as problem

    return problem(offload, swap_bytes)


def expert_parallel_problem(zero_stage: int, ep: int) -> Optional[str]:
    from megaframe.backends.deepspeed.system import expert_parallel_problem as problem

    return problem(zero_stage, ep)


def stage_boundaries(weights: tuple, pp: int) -> tuple:
    from megaframe.backends.deepspeed.pipeline import stage_boundaries as boundaries

    return boundaries(weights, pp)


PLUG = EnginePlug(name="deepspeed", build=build, init_distributed=init_distributed,
                  device_supports_fp16=device_supports_fp16, device_supports_bf16=device_supports_bf16,
                  system_problem=system_problem, expert_parallel_problem=expert_parallel_problem,
                  stage_boundaries=stage_boundaries)
