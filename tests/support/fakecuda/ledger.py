"""What the device saw: refused operations (violations), device-to-host reads (syncs) and host-to-device
copies (uploads, in bytes), each with the call site outside torch and this tier, so a failing test
names the line of megaframe to fix."""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path

from tests.support.fakecuda import downloads

_HERE = str(Path(__file__).resolve().parent) + os.sep
_TORCH = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))
_SKIP = (_HERE, os.path.join(_TORCH, "torch") + os.sep, "<frozen")
_lock = threading.Lock()
syncs: Counter = Counter()  # (kind, call site) -> count
violations: list[dict] = []  # {"message", "site"}, in order
kernels: Counter = Counter()  # emulated CUDA-only kernel -> calls (kernels.py)
uploads: Counter = Counter()  # call site -> bytes copied from host memory to the device


class CudaError(RuntimeError):
    """What CUDA or NCCL would have raised."""


def call_site() -> str:
    """file:line (function) of the nearest frame outside torch and this tier."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def count_sync(kind: str) -> None:
    """A device-to-host read: on CUDA the host waits for the stream here (and so for every copy queued)."""
    downloads.land()
    site = call_site()
    with _lock:
        syncs[(kind, site)] += 1


def count_upload(nbytes: int) -> None:
    """A host-to-device copy of nbytes (Tensor.to, copy_ into a device tensor)."""
    site = call_site()
    with _lock:
        uploads[site] += nbytes


def refuse(message: str) -> CudaError:
    """Record a violation and return the error to raise (code may catch it; the ledger keeps it)."""
    with _lock:
        violations.append({"message": message, "site": call_site()})
    return CudaError(message)


def snapshot() -> dict:
    """A picklable copy: syncs as [kind, site, count] rows, violations as dicts."""
    with _lock:
        return {"syncs": [[kind, site, n] for (kind, site), n in syncs.items()], "violations": list(violations),
                "kernels": dict(kernels), "uploads": dict(uploads)}


def reset() -> None:
    with _lock:
        syncs.clear()
        violations.clear()
        kernels.clear()
        uploads.clear()


def _write_report() -> None:
    directory = os.environ.get("MEGAFRAME_FAKE_CUDA_REPORT")
    if not directory:
        return
    record = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv": sys.argv[:3], **snapshot()}
    path = Path(directory) / f"fakecuda-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)


def write_report_at_exit() -> None:
    """MEGAFRAME_FAKE_CUDA_REPORT=DIR: each process writes DIR/fakecuda-PID.json when it exits."""
    atexit.register(_write_report)
    # forked children (run_ranks, torch.multiprocessing) leave by os._exit: no atexit there
    os.register_at_fork(after_in_child=reset)


def read_reports(directory: Path) -> list[dict]:
    """Every process's report in DIR."""
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("fakecuda-*.json"))]
