"""The GPU tier: `python -m pytest tests/gpu` on a machine with CUDA. Without one, every test here
is skipped with that reason (the CPU suite runs everything else); the multi-GPU tests also need two."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="tests/gpu needs a CUDA device and this machine has none; "
                                   "run `python -m pytest tests/gpu` on a GPU machine")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
