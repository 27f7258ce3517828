"""The CPU reference curve shared by a file's device runs (tests/fakecuda/runs.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory) -> list[dict]:
    from fakecuda.runs import cpu_run

    return cpu_run(tmp_path_factory.mktemp("cpu"))
