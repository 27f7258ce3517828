"""DeepSpeed as megaframe's registry sees it (backends/registry.py). Every entry imports its module
when called: importing this file imports no DeepSpeed."""
from __future__ import annotations

from megaframe.backends.registry import lazy_plug

PLUG = lazy_plug("deepspeed", build="engine:DeepSpeedBackend", init_distributed="engine:init_distributed",
                 device_type="accelerator:device_type",
                 device_supports_fp16="accelerator:device_supports_fp16",
                 device_supports_bf16="accelerator:device_supports_bf16",
                 system_problem="system:system_problem", expert_parallel_problem="system:expert_parallel_problem",
                 stage_boundaries="pipeline:stage_boundaries", config_problem="rules:config_problem", layout_problem="rules:layout_problem",
                 config_warnings="rules:config_warnings")
