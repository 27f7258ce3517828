"""How a step loop of small operations slows while rank 0 deletes a pruned checkpoint: the trash's rm
child process (checkpoint/store.py empty_trash) against a Python rmtree on the same thread.

usage: python tools/bench_trash.py [--files 100000] [--rounds 2]

Each round builds a tmp-del- folder of FILES one-byte files in the temp folder, starts the trash's
collector on it, and times a launch-bound step (200 small matmuls, one thread: the pace at which a GPU's
kernels are launched) until the delete is done; the step's median with nothing deleting is the baseline.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import megaframe  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))


def _tree(root: Path, files: int) -> None:
    folder = root / "tmp-del-global_step1"
    for i in range(files):
        if i % 250 == 0:
            (folder / f"d{i // 250}").mkdir(parents=True)
        (folder / f"d{i // 250}" / f"f{i}").write_bytes(b"x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import torch

    from megaframe.checkpoint import store

    torch.set_num_threads(1)
    x = torch.randn(64, 64)

    def step() -> None:
        y = x
        for _ in range(200):
            y = torch.tanh(y @ x) * 0.5

    def timed_steps(until) -> list[float]:
        times = []
        while not until():
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times

    for _ in range(20):
        step()
    quiet_end = time.perf_counter() + 3
    baseline = statistics.median(timed_steps(lambda: time.perf_counter() > quiet_end))
    print(f"no delete: step median {baseline * 1e3:.2f} ms")
    rm_child = store.empty_trash

    def python_rmtree(directory: Path) -> None:  # what the trash's thread ran before
        for trash in Path(directory).glob(store.TRASH_PREFIX + "*"):
            shutil.rmtree(trash, ignore_errors=True)
    for _ in range(args.rounds):
        for name, delete in (("python rmtree", python_rmtree), ("rm child", rm_child)):
            with tempfile.TemporaryDirectory(prefix="megaframe-bench-trash-") as root:
                _tree(Path(root), args.files)
                store.empty_trash = delete
                trash = store.TrashCollector()
                started = time.perf_counter()
                trash.collect(Path(root))
                times = timed_steps(lambda: trash.wait(0)) or [float("nan")]  # nan: done before a step
                took = time.perf_counter() - started
                store.empty_trash = rm_child
            print(f"{name}: {args.files:,} files deleted in {took:.2f} s; step median "
                  f"{statistics.median(times) * 1e3:.2f} ms over {len(times)} steps", flush=True)


if __name__ == "__main__":
    main()
