"""Torchrun agents as "nodes" on this host, for the elastic tests (tests/e2e/test_elastic*.py):
starting them, killing one with everything under it, and reading the run's metrics meanwhile."""
from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from tests.support.helpers import TINY, read_metrics

# global batch 12 of micro-batches of 2: 6, 3 and 2 micro-batches per rank at dp 1, 2 and 3.
# optim.lr=3e-4: at the default 3e-3 this tiny model's training amplifies the last-bit differences
# of another reduction order (dp=2 sums 3+3 micro-batch gradients, one rank 6 in a row) to 2e-5 by
# step 30 and 1e-3 by step 200 with or without a resize (measured: one rank against dp=2, both
# uninterrupted); at 3e-4 the two stay within 1.6e-7 over 200 steps, so a 1e-5 gap means a resize
# lost or repeated something
# The rendezvous waits (launcher.rdzv_*, docs/elastic.md), which no test measures: a killed node is
# dropped after 3 missed heartbeats, 2 s apart (torchrun's 5 s: 15 s), and a round the survivors hold
# starts 15 s after the first of them joined (torchrun's 30 s). That last call also bounds how long the
# second and third nodes may take to start and join node 0's first round (all three make it complete at
# once): it stays well above their start-up on a loaded two-core host.
REGROUP_ARGS = ["launcher.rdzv_keep_alive_s=2", "launcher.rdzv_last_call_s=15"]
ELASTIC_ARGS = [*TINY, "parallel.global_batch_size=12", "zero=stage1", "train.save_interval=1",
                "train.keep_checkpoints=2", "train.eval_interval=0", "train.collective_timeout_s=60", "optim.lr=3e-4",
                *REGROUP_ARGS]


def read_records(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError):  # read while rank 0 appends
        return []


def wait_for(what: str, ready, nodes: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if all(node.poll() is not None for node in nodes):
            raise AssertionError(f"every node exited while waiting for {what}: {[n.returncode for n in nodes]}")
        time.sleep(0.1)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a node: its torchrun agent and every process under it (its workers run in sessions
    of their own, so killing the agent's process group would leave them training)."""
    agent = psutil.Process(node.pid)
    tree = [agent, *agent.children(recursive=True)]
    for process in tree:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    node.wait(timeout=30)


def steps_trained(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


class Nodes:
    """Torchrun agents, each running RUN_DIR/elastic_node.sh with its own log under `logs_dir`.
    As a context manager: any failure inside carries every node's log tail, and every node still
    running at the end is killed (agent and workers)."""

    def __init__(self, script: Path, logs_dir: Path, repo: Path):
        self.script, self.logs_dir, self.repo = script, logs_dir, repo
        self.procs: list[subprocess.Popen] = []
        self._logs = []

    def start(self, env: dict[str, str]) -> subprocess.Popen:
        log = open(self.logs_dir / f"node{len(self.procs)}.log", "w")
        self._logs.append(log)
        self.procs.append(subprocess.Popen(["bash", str(self.script)], cwd=self.repo, env=env, stdout=log,
                                           stderr=subprocess.STDOUT))
        return self.procs[-1]

    def story(self, tail: int | None = 3000) -> str:
        """Each node's log, its last `tail` characters (None: whole) -- enough to read in a failure message."""
        return "\n".join(f"--- node{i}\n{(self.logs_dir / f'node{i}.log').read_text()[-(tail or 0):]}"
                         for i in range(len(self.procs)))

    def __enter__(self) -> "Nodes":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for node in self.procs:
            if node.poll() is None:
                kill_node(node)
        for log in self._logs:
            log.close()
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            raise AssertionError(f"{exc}\n{self.story()}") from exc
