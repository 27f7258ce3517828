"""What an epoch's order costs a host's ranks: each rank its own in memory against one shared through
data.cache_dir (megaframe/data/epoch_orders.py).

usage: python tools/bench_orders.py [--samples 134217728] [--ranks 4]

RANKS forked processes ask at once for the sample indices of steps 0 and 100 (global batch 512) of a
sample set of SAMPLES samples, first each with its own order, then through a shared file in a temporary
folder (removed after). Printed per way: the slowest process's first step (the shuffle, or waiting for
the one process that builds the file) and each process's proportional set size (PSS, /proc's
smaps_rollup: a page mapped by k processes counts 1/k to each) after both steps; then, after a step
at 95% of the epoch (from which the shared way builds the next epoch's file on a thread) and that
build, the slowest process's step that crosses into the next epoch.
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _pss_mib() -> float:
    with open("/proc/self/smaps_rollup") as rollup:
        kib = next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
    return kib / 1024


def _rank(directory: str | None, samples: int, results, barrier) -> None:
    from megaframe.data.dataset import global_batch_indices
    from megaframe.data.epoch_orders import IN_MEMORY, EpochOrders

    orders = EpochOrders(Path(directory), shared_from=1) if directory else IN_MEMORY
    barrier.wait()
    started = time.perf_counter()
    global_batch_indices(0, 512, samples, 1234, orders)
    first = time.perf_counter() - started
    global_batch_indices(100, 512, samples, 1234, orders)
    pss = _pss_mib()
    global_batch_indices(int(0.95 * samples) // 512, 512, samples, 1234, orders)  # late in the epoch
    for thread in orders.prefetches:  # the next epoch's order, built ahead meanwhile (shared way)
        thread.join()
    barrier.wait()
    started = time.perf_counter()
    global_batch_indices(samples // 512, 512, samples, 1234, orders)  # crosses into epoch 1
    results.put((first, pss, time.perf_counter() - started))
    barrier.wait()  # every process measured before any exits


def _measure(directory: str | None, samples: int, ranks: int) -> list[tuple[float, float, float]]:
    context = multiprocessing.get_context("fork")
    results, barrier = context.Queue(), context.Barrier(ranks)
    processes = [context.Process(target=_rank, args=(directory, samples, results, barrier)) for _ in range(ranks)]
    for process in processes:
        process.start()
    measured = [results.get(timeout=3600) for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode != 0:
            sys.exit(f"bench_orders: a process exited with {process.exitcode}")
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2**27)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-orders-") as folder:
        for way, directory in (("own order", None), ("shared file", folder)):
            measured = _measure(directory, args.samples, args.ranks)
            pss = [mib for _, mib, _ in measured]
            first, boundary = max(t for t, _, _ in measured), max(t for _, _, t in measured)
            print(f"{way}: {args.samples:,} samples, {args.ranks} processes: first step {first:.2f} s (slowest), "
                  f"PSS {statistics.mean(pss):.0f} MiB per process, {sum(pss):.0f} MiB in all; the step into "
                  f"the next epoch {boundary:.2f} s", flush=True)


if __name__ == "__main__":
    main()
