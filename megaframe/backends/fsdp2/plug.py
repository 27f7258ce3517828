"""FSDP2 as megaframe's registry sees it (backends/registry.py). Every entry imports its module when
called: asking for the plug or refusing a config imports no torch.distributed.fsdp."""
from __future__ import annotations

from megaframe.backends.registry import lazy_plug

PLUG = lazy_plug("fsdp2", build="engine:Fsdp2Backend", init_distributed="engine:init_distributed", device_type="engine:device_type",
                 device_supports_fp16="engine:device_supports_fp16", device_supports_bf16="engine:device_supports_bf16",
                 system_problem="rules:system_problem", expert_parallel_problem="rules:expert_parallel_problem",
                 stage_boundaries="rules:stage_boundaries", config_problem="rules:config_problem", layout_problem="rules:layout_problem",
                 config_warnings="rules:config_warnings")
