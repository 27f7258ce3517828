"""run_ranks: real processes on gloo with a file store (no port races), for in-process rank tests."""
from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.cli_zygote import import_what_runs_import
from tests.support.compile_turns import take_turns_at_compiles
from tests.support.composed import compose_before_fork


# deepspeed.initialize imports torch._dynamo (torch's Optimizer) and DeepSpeed's Muon module, which
# runs torch.compile at import: 10-15 s per process on this machine, paid again by every forked rank
# of every test unless the parent has done it (a speed-up only)
import_what_runs_import()


def _save_record(record: dict, out: Path) -> None:
    # written aside and renamed: the harness kills the surviving ranks once one has failed, and a
    # record cut off mid-write would hide the first failure behind an unreadable file
    partial = out.with_suffix(".partial")
    torch.save(record, partial)
    os.replace(partial, out)


def _entry(rank: int, fn: Callable, world_size: int, workdir: str, kwargs: dict) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.pop("LOCAL_SIZE", None)  # DeepSpeed would leave 66 MiB shm buffers behind
    torch.set_num_threads(1)
    out = Path(workdir) / f"rank{rank}.pt"
    take_turns_at_compiles(f"{workdir}/inductor.lock")  # one rank compiles a graph, the others load it (a speed-up)
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
        result = fn(rank, world_size, **kwargs)
        dist.barrier()
        _save_record({"ok": True, "result": result}, out)
    except BaseException:
        # when it failed: a peer's failure shows up on the others as closed connections, later
        _save_record({"ok": False, "error": traceback.format_exc(), "at": time.time()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, timeout: float = 600, **kwargs: Any) -> list[Any]:
    """Run fn(rank, world_size, **kwargs) in world_size forked processes; return each rank's result.

    fork (not spawn) keeps test-local functions usable; a rank that raises fails the test with its
    traceback, and a run past `timeout` seconds is killed rather than left to hang CI.
    """
    workdir = Path(tmp_path) / f"ranks-{time.monotonic_ns()}"
    workdir.mkdir(parents=True)
    compose_before_fork(fn, kwargs)  # once here, not once per rank (tests/support/composed.py)
    context = mp.start_processes(_entry, args=(fn, world_size, str(workdir), kwargs), nprocs=world_size,
                                 join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout}s")
    except mp.ProcessRaisedException:
        pass  # reported below with every failing rank's traceback
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    records = {rank: torch.load(workdir / f"rank{rank}.pt", weights_only=False)
               for rank in range(world_size) if (workdir / f"rank{rank}.pt").exists()}
    # the first rank to fail caused it: the others fail after it, with "Connection closed by peer"
    failed = sorted((record["at"], rank) for rank, record in records.items() if not record["ok"])
    if failed:
        first = failed[0][1]
        others = ", ".join(str(rank) for _, rank in failed[1:])
        also = f"\n(ranks {others} failed after it)" if others else ""
        raise RuntimeError(f"rank {first} failed:\n{records[first]['error']}{also}")
    for rank in range(world_size):
        if rank not in records:
            raise RuntimeError(f"rank {rank} died without a result (exit code {context.processes[rank].exitcode})")
    return [records[rank]["result"] for rank in range(world_size)]
