"""Test-session environment: DeepSpeed on CPU, one JIT cache for every test process."""
from __future__ import annotations

import os
from pathlib import Path

# DeepSpeed JIT-compiles its CPU ops on first use; one cache for every test process (and CI).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "megaframe" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(items):
    """Multi-rank and end-to-end files first (the sort is stable): under `-n 2 --dist loadfile` the
    long files start early and the many short unit tests fill the gaps at the end."""
    items.sort(key=lambda item: "tests/unit/" in str(item.path).replace(os.sep, "/"))
