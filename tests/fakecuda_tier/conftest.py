"""The CPU reference run shared by a file's device runs (tests/support/fakecuda/runs.py)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def cpu_reference_run(tmp_path_factory) -> Path:
    """The plain CPU run's folder (its metrics and its final checkpoint), trained once per session."""
    from tests.support.fakecuda.runs import cpu_run_dir

    return cpu_run_dir(tmp_path_factory.mktemp("cpu"))


@pytest.fixture(scope="module")
def cpu_reference(cpu_reference_run) -> list[dict]:
    from tests.support.helpers import read_metrics

    return read_metrics(cpu_reference_run)
