"""Test-session environment: DeepSpeed on CPU, one JIT cache for every test process."""
from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

# DeepSpeed JIT-compiles its CPU ops on first use; one cache for every test process (and CI).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "megaframe" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# torch's inductor cache is not keyed on ATEN_CPU_CAPABILITY: kernels cached under another
# capability fail to compile under =default ("'at::vec' has not been declared", torch 2.13). A run
# that forces a capability gets a cache of its own.
if capability := os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_{capability}"))


def pytest_collection_modifyitems(items):
    """Multi-rank and end-to-end files first (the sort is stable): under `-n 2 --dist loadfile` the
    long files start early and the many short unit tests fill the gaps at the end."""
    items.sort(key=lambda item: "tests/unit/" in str(item.path).replace(os.sep, "/"))
