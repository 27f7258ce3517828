"""DeepSpeed's lines a user cannot act on are dropped (backends/deepspeed/__init__.py): its CPU-fallback
line without touching the environment (a SLURM or Ray job inherits the environment of the process
that submits it, so a DS_ACCELERATOR=cpu set on a login node would put every GPU rank of the job on
its CPU), and its untested-optimizer warning for megaframe's Muon under ZeRO."""
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


_UNTESTED = """
import inspect, re
import megaframe.backends.deepspeed.engine  # imports DeepSpeed under megaframe's filter
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger
source = inspect.getsource(DeepSpeedEngine._do_optimizer_sanity_check)
[line] = re.findall(r'logger\\.warning\\("(\\*\\*\\*\\* You are using ZeRO with an untested[^"]*)"\\)', source)
logger.warning(line)  # what DeepSpeed's engine logs at its rank 0 for megaframe's Muon under ZeRO
logger.warning("**** another DeepSpeed warning *****")
"""


def test_deepspeeds_untested_optimizer_line_is_dropped_and_its_other_warnings_are_not():
    """optim=muon under ZeRO printed DeepSpeed's '**** You are using ZeRO with an untested optimizer,
    proceed with caution *****' on the terminal; megaframe's tests compare that Muon with the
    single-rank run at each ZeRO stage. The line is read from the installed DeepSpeed's own source."""
    result = subprocess.run([sys.executable, "-c", _UNTESTED], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "another DeepSpeed warning" in output
    assert "untested optimizer" not in output
