"""DeepSpeed's CPU-fallback line is dropped without touching the environment: a SLURM or Ray job
inherits the environment of the process that submits it, so a DS_ACCELERATOR=cpu set on a login node
would put every GPU rank of the job on its CPU."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.helpers import REPO

_CHILD = """
import os
import megaframe.backends.deepspeed.engine  # imports DeepSpeed, which picks its accelerator
from deepspeed.accelerator import get_accelerator
print(get_accelerator().device_name(), os.environ.get("DS_ACCELERATOR", "unset"))
"""


def test_no_fallback_line_and_no_environment_change():
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU here either way: DeepSpeed falls back to its CPU accelerator
    result = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["cpu", "unset"]
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr
