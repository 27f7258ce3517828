"""DeepSpeed as megaframe's registry sees it (backends/registry.py). Every entry imports its module
when called: importing this file imports no DeepSpeed."""
from __future__ import annotations

import importlib
from typing import Any, Callable

from megaframe.backends.registry import EnginePlug


def _on_call(module: str, name: str) -> Callable[..., Any]:
    """backends/deepspeed/MODULE.py's NAME, imported when first called."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(f"megaframe.backends.deepspeed.{module}"), name)(*args, **kwargs)

    return call


PLUG = EnginePlug(name="deepspeed", build=_on_call("engine", "DeepSpeedBackend"),
                  init_distributed=_on_call("engine", "init_distributed"),
                  device_supports_fp16=_on_call("accelerator", "device_supports_fp16"),
                  device_supports_bf16=_on_call("accelerator", "device_supports_bf16"),
                  system_problem=_on_call("system", "system_problem"),
                  expert_parallel_problem=_on_call("system", "expert_parallel_problem"),
                  stage_boundaries=_on_call("pipeline", "stage_boundaries"),
                  config_problem=_on_call("rules", "config_problem"),
                  config_warnings=_on_call("rules", "config_warnings"))
