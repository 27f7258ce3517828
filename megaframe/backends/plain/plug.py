"""What the one-process plain engine brings to megaframe's registry (backends/registry.py): how it
builds, joins its world of one and names its device, each as "module:function" imported when first
called. Its rules are those of the engine it stands in for (DeepSpeed's), which validated the run."""
from __future__ import annotations

RUNS = {"build": "engine:PlainBackend", "init_distributed": "engine:init_distributed",
        "device_type": "engine:device_type"}
# the start-up line, after backend=deepspeed (registry.engine_said)
SAID = "as plain torch (one process: DeepSpeed's step, bit for bit, without its engine; backend.plain_one_process=false runs it)"
