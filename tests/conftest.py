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
# capability fail to compile under =default ("'at::vec' has not been declared", torch 2.13) or
# abort the process when loaded. The suite keeps one cache per capability of its own, so what
# other runs on the machine left in torch's default cache cannot break it.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    capability = os.environ.get("ATEN_CPU_CAPABILITY") or "host"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
        Path(tempfile.gettempdir()) / f"megaframe-tests-inductor-{getpass.getuser()}-{capability}")


def pytest_collection_modifyitems(items):
    """Multi-rank and end-to-end files first (the sort is stable): under `-n 2 --dist loadfile` the
    long files start early and the many short unit tests fill the gaps at the end."""
    items.sort(key=lambda item: "tests/unit/" in str(item.path).replace(os.sep, "/"))
