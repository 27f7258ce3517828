"""A pytest plugin that records each test's CPU seconds, for finding where the suite's time goes:

    MEGAFRAME_CPU_PROFILE=/tmp/prof python -m pytest -q -n 3 --dist loadfile -p tests.support.cpu_profile
    python -m tests.support.cpu_profile /tmp/prof          # CPU seconds per test file, largest first

Each worker appends one JSON line per test to DIR/cpu-WORKER.jsonl: the CPU time of the worker and
of the children it waited for (os.times), and the wall time. Work done in a process the test did
not wait for (the warm interpreters of tests/support/cli_zygote.py and console_zygote.py, which
live for the whole run) is not counted in the test that asked for it."""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.environ.get("MEGAFRAME_CPU_PROFILE")
    cpu, wall = _cpu(), time.monotonic()
    yield
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        record = {"id": item.nodeid, "cpu": _cpu() - cpu, "wall": time.monotonic() - wall}
        with open(Path(folder) / f"cpu-{worker}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def main(folder: str) -> None:
    by_file: collections.Counter = collections.Counter()
    for path in Path(folder).glob("cpu-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_file[record["id"].split("::")[0]] += record["cpu"]
    print(f"{sum(by_file.values()):.0f} CPU-s in {len(by_file)} files")
    for name, seconds in by_file.most_common(30):
        print(f"{seconds:8.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
