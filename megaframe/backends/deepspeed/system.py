"""What the machine must provide for a layout, checked before any rank starts.

DeepSpeed finds these late: a missing libaio ends NVMe offload inside deepspeed.initialize, after
the ranks have started, in a 90-line traceback; a missing compiler fails CPU-Adam's JIT build the
same way; a full or read-only nvme_path fails at the first swap. Each is one line here instead.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Optional

from deepspeed.accelerator import get_accelerator

from megaframe.backends.deepspeed.build_locks import extensions_dir
from megaframe.common.paths import nearest_existing
from megaframe.config.schema import OffloadConfig


def _op_built(name: str) -> bool:
    """Whether the JIT-built op is already in the extensions directory (no compiler needed then)."""
    return any((extensions_dir() / name).glob(f"{name}*.so"))


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++"))


def check_nvme_path(nvme_path: str, swap_bytes: float) -> Optional[str]:
    """The swap folder's file system: writable, with room for swap_bytes."""
    where = nearest_existing(Path(nvme_path))
    if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
        return (f"offload.nvme_path={nvme_path} is not writable ({where} is the nearest existing folder); "
                f"point it at a writable local NVMe folder")
    free = shutil.disk_usage(where).free
    if free < swap_bytes:
        return (f"offload.nvme_path={nvme_path}: {free / 2**30:.1f} GiB free, the planned swap of this host's ranks "
                f"needs {swap_bytes / 2**30:.1f} GiB; free space there or choose a larger NVMe folder")
    return None


def system_problem(offload: OffloadConfig, swap_bytes: float) -> Optional[str]:
    """The first system piece this offload setting lacks on this machine, as one line (None: all there).

    swap_bytes: what this host's ranks will swap to offload.nvme_path (the planner's offloaded bytes)."""
    nvme = "nvme" in (offload.optimizer, offload.param)
    if nvme:
        aio = get_accelerator().create_op_builder("AsyncIOBuilder")
        if aio is None or not aio.is_compatible(verbose=False):
            return ("offload=nvme: DeepSpeed's async-IO op cannot load on this machine (libaio is missing); install "
                    "it (apt-get install libaio-dev, or yum install libaio-devel) or use offload=cpu")
    if offload.optimizer != "none":  # DeepSpeed's CPU Adam steps offloaded optimizer states
        adam = get_accelerator().create_op_builder("CPUAdamBuilder")
        if adam is None or not adam.is_compatible(verbose=False):
            return f"offload.optimizer={offload.optimizer}: DeepSpeed's CPU Adam cannot build on this machine; use offload=none"
        if not _op_built(adam.name) and _compiler() is None:
            return (f"offload.optimizer={offload.optimizer}: DeepSpeed's CPU Adam is compiled on first use, and no C++ "
                    f"compiler was found ({os.environ.get('CXX', 'c++')}); install one (apt-get install g++) or set CXX")
    if nvme and offload.nvme_path:
        return check_nvme_path(offload.nvme_path, swap_bytes)
    return None


def expert_parallel_problem(zero_stage: int, ep: int) -> Optional[str]:
    """ZeRO-3 partitions experts over their expert-data-parallel ranks through DeepSpeed's AutoEP
    placement (backends/deepspeed/experts.py), which older DeepSpeeds lack."""
    if zero_stage != 3 or ep == 1 or importlib.util.find_spec("deepspeed.module_inject.auto_ep_layer") is not None:
        return None
    import deepspeed

    return (f"zero=stage3 with parallel.ep={ep} needs DeepSpeed's AutoEP expert placement, which deepspeed "
            f"{deepspeed.__version__} lacks; upgrade deepspeed, or use zero=stage1/stage2 (or parallel.ep=1)")
