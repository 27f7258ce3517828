"""NVMe swap folders for ZeRO-Infinity: one per process, removed at exit and, after a crash, at the next start.

DeepSpeed writes its swap files under the offload `nvme_path` and never deletes them; a killed run
leaves gigabytes behind. Each process swaps into NVME_PATH/megaframe-swap/HOST-PID: a folder whose
owner is gone (same host, dead pid) is debris and is removed when the next run starts, while
folders of runs still alive on this or another host are left alone.
"""
from __future__ import annotations

import atexit
import os
import shutil
import socket
from pathlib import Path

SWAP_FOLDER = "megaframe-swap"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale(nvme_path: str | Path, host: str | None = None) -> list[Path]:
    """Delete the swap folders of dead processes of this host under nvme_path; return what was removed."""
    host = host or socket.gethostname()
    removed = []
    for folder in sorted((Path(nvme_path) / SWAP_FOLDER).glob(f"{host}-*")):
        pid = folder.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class NvmeSwap:
    """This process's swap folder: created empty, removed by remove(), at interpreter exit at the latest."""

    def __init__(self, nvme_path: str | Path):
        self.removed_stale = remove_stale(nvme_path)
        self.path = Path(nvme_path) / SWAP_FOLDER / f"{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        atexit.register(self.remove)

    def files(self) -> dict[str, int]:
        """Swap files written so far: path relative to the folder -> bytes."""
        return {str(f.relative_to(self.path)): f.stat().st_size for f in self.path.rglob("*") if f.is_file()}

    def remove(self) -> None:
        """Delete the folder and everything in it (idempotent)."""
        shutil.rmtree(self.path, ignore_errors=True)
        parent = self.path.parent
        try:
            parent.rmdir()  # only when no other run swaps there
        except OSError:
            pass


def honour_explicit_zero_init_dtype() -> None:
    """Work around DeepSpeed 0.19's zero.Init dtype choice (idempotent).

    Given an explicit dtype, Init computes `dtype or fp16 if <device has fp16> else bf16` (operator
    precedence), so on a device without fp16 (CPUs) an fp32 model gets an NVMe parameter swapper
    built for bf16, and swapped-in weights come back as bf16: the first forward fails with a dtype
    mismatch. The engine always passes the model's own dtype; this makes Init keep it, as intended.
    """
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit

    if getattr(ZeroInit._set_dtype, "honours_explicit_dtype", False):
        return
    choose_dtype = ZeroInit._set_dtype

    def set_dtype(self, ds_config, dtype):
        choose_dtype(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype
    set_dtype.honours_explicit_dtype = True
    ZeroInit._set_dtype = set_dtype


def open_nvme_swap(offload) -> NvmeSwap | None:
    """This process's swap folder when anything is offloaded to NVMe (offload: OffloadConfig), else None."""
    if "nvme" not in (offload.optimizer, offload.param):
        return None
    if offload.param == "nvme":
        honour_explicit_zero_init_dtype()
    return NvmeSwap(offload.nvme_path)
