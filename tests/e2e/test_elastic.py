"""Elastic training (elastic_launch.py) with real torchrun agents, one rank each, on this host as
three "nodes": kill one node (its agent and its worker) mid-run and the job goes on at dp=2; start a
node and it grows back to dp=3; every step is in metrics.jsonl once, with an uninterrupted one-rank
run's loss. The per-node command comes from megaframe-train itself (RUN_DIR/elastic_node.sh)."""
from __future__ import annotations

import math
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from helpers import REPO, TINY, assert_ok, cli_env, free_port, read_metrics, run_cli

pytestmark = pytest.mark.slow
# long enough that the dp=2 stretch outlasts a joining node's start-up (each step is ~0.1 s here)
STEPS = 200
# global batch 12 of micro-batches of 2: 6, 3 and 2 micro-batches per rank at dp 1, 2 and 3.
# optim.lr=3e-4: at the default 3e-3 this tiny model's training amplifies the last-bit differences
# of another reduction order (dp=2 sums 3+3 micro-batch gradients, one rank 6 in a row) to 2e-5 by
# step 30 and 1e-3 by step 200 with or without a resize (measured: one rank against dp=2, both
# uninterrupted); at 3e-4 the two stay within 1.6e-7 over 200 steps, so a 1e-5 gap means a resize
# lost or repeated something
ARGS = [*TINY, "parallel.global_batch_size=12", "zero=stage1", f"train.max_steps={STEPS}", "train.save_interval=1",
        "train.keep_checkpoints=2", "train.eval_interval=0", "train.collective_timeout_s=60", "optim.lr=3e-4"]


def _records(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError):  # read while rank 0 appends
        return []


def _wait_for(what: str, ready, nodes: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if all(node.poll() is not None for node in nodes):
            raise AssertionError(f"every node exited while waiting for {what}: {[n.returncode for n in nodes]}")
        time.sleep(0.1)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _kill_node(node: subprocess.Popen) -> None:
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


def _trained(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_elastic_job_loses_a_node_goes_on_at_dp2_and_grows_back(tmp_path, engine):
    whole, run = tmp_path / "whole", tmp_path / "elastic"
    args = [*ARGS, f"backend={engine}"] + (["zero=stage3"] if engine == "fsdp2" else [])  # FSDP2 has no ZeRO-1
    assert_ok(run_cli([*args, f"hydra.run.dir={whole}"]))  # one rank, uninterrupted

    port = free_port()
    printed = run_cli([*args, "launcher.min_nodes=1", "launcher.nodes=3", "launcher.gpus_per_node=1",
                       f"launcher.rdzv_endpoint=127.0.0.1:{port}", f"hydra.run.dir={run}"])
    assert_ok(printed)
    script = run / "elastic_node.sh"
    assert str(script) in printed.stdout and "--nnodes=1:3" in script.read_text()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script.read_text()

    logs = []

    def start_node() -> subprocess.Popen:
        log = open(tmp_path / f"node{len(logs)}.log", "w")
        logs.append(log)
        return subprocess.Popen(["bash", str(script)], cwd=REPO, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)

    # every agent here matches the endpoint's host, and the first to bind its port hosts the c10d
    # store: the rest start once node 0 holds it, so the node killed below is not the host (whose
    # loss ends an elastic job: torchrun's limit, docs/elastic.md)
    nodes = [start_node()]
    _wait_for("node 0's rendezvous store", lambda: _listening(port), nodes, timeout=60)
    nodes += [start_node(), start_node()]
    story = lambda: "\n".join(f"--- node{i}\n{(tmp_path / f'node{i}.log').read_text()[-3000:]}" for i in range(len(logs)))
    try:
        _wait_for("step 5 at dp=3", lambda: any(r["step"] >= 5 and r.get("dp") == 3 for r in _trained(_records(run))),
                  nodes)
        _kill_node(nodes[2])
        killed_at = max(r["step"] for r in _trained(_records(run)))
        _wait_for("training at dp=2", lambda: any(r.get("dp") == 2 for r in _trained(_records(run))), nodes[:2])
        nodes.append(start_node())
        _wait_for("training at dp=3 again",
                  lambda: any(r.get("dp") == 3 and r["step"] > killed_at for r in _trained(_records(run))), nodes)
        for node in (nodes[0], nodes[1], nodes[3]):
            assert node.wait(timeout=300) == 0, story()
    except BaseException as err:
        raise AssertionError(f"{err}\n{story()}") from err
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_node(node)
        for log in logs:
            log.close()

    records = _records(run)
    trained = _trained(records)
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1)), story()  # each step once
    sizes = [r["dp"] for r in trained]
    changes = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert changes == [3, 2, 3], (sizes, story())
    assert all(r["world_size"] == r["dp"] for r in trained)
    resized = [r for r in records if r.get("event") == "resized"]
    assert [(r["dp"]) for r in resized] == [2, 3], resized
    reference = {r["step"]: r["loss"] for r in _trained(read_metrics(whole))}
    worst = max(abs(r["loss"] - reference[r["step"]]) for r in trained)
    assert worst <= 1e-5 and all(math.isfinite(r["loss"]) for r in trained), worst


def test_a_deterministic_failure_stops_an_elastic_job_once(tmp_path):
    """No shared agent store under the elastic setting: the stop record is a file in the run dir
    keyed by the rendezvous id, read by every node's later attempts, which exit at once."""
    run = tmp_path / "run"
    diverging = [*TINY, "zero=stage1", "optim.lr=1e6", "train.max_steps=30", "launcher.min_nodes=1",
                 "launcher.nodes=2", "launcher.gpus_per_node=1", "launcher.max_restarts=2",
                 f"launcher.rdzv_endpoint=127.0.0.1:{free_port()}", f"hydra.run.dir={run}"]
    assert_ok(run_cli(diverging))
    script = run / "elastic_node.sh"
    nodes = [subprocess.Popen(["bash", str(script)], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=400)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_node(node)
    story = "\n".join(f"--- node{i}\n{out[-3000:]}" for i, out in enumerate(outputs))
    assert all(node.returncode != 0 for node in nodes), story
    records = list((run / ".job_stop").glob("megaframe-*.json"))
    assert len(records) == 1 and '"exit_code": 3' in records[0].read_text(), story
    said = "\n".join(outputs)
    assert "diverged" in said and "not retrying: an earlier attempt of this job failed with: diverged" in said, story
    assert said.count("megaframe: gpt2") == 1, story  # rank 0's start-up line: the first attempt trained, no restart did
    assert said.count("not retrying") == 2, story  # launcher.max_restarts=2: each restart stopped at once
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == sorted(set(steps)), f"a restart replayed steps: {steps}"
