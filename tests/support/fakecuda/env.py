"""The environment of a subprocess whose Python processes all start on the device (sitecustomize.py)."""
from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def fake_cuda_env(report_dir, **extra: str) -> dict[str, str]:
    """cli_env() plus MEGAFRAME_FAKE_CUDA=1, this folder first on PYTHONPATH (its sitecustomize), and
    each process's report written to report_dir when it exits."""
    from tests.support.helpers import cli_env

    path = [str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]
    return cli_env(MEGAFRAME_FAKE_CUDA="1", MEGAFRAME_FAKE_CUDA_REPORT=str(report_dir),
                   PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)
