"""Elastic training under launcher=ray (Ray Train's num_workers=(MIN, MAX)) on a Ray cluster of two
"nodes" on this host: a head with room for 2 workers and a second raylet with room for 1. The job
starts at dp=3; the second node is killed (its raylet, its rank and every other process of it) and
Ray restarts the worker group with the 2 workers that still fit, which resume from the last
checkpoint: every step is in metrics.jsonl once, with an uninterrupted one-rank run's loss.

The cluster is this test's own: its processes are found by the temp dirs it was started with and
killed by pid, never with `ray stop` (which kills every Ray process on the host, also the clusters
of other test files that may run beside this one)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.helpers import REPO, TINY, assert_ok, cli_env, free_port, read_metrics, run_cli
from tests.support.ray_processes import LEAN_RAY, kill_processes, process_tree, processes_of

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason="Ray is the optional extra megaframe[ray]; .ci/run installs it with [test]")

STEPS = 40
# test_elastic.py's job: global batch 12 (6, 3 and 2 micro-batches per rank at dp 1, 2 and 3) and
# optim.lr=3e-4, at which one rank and dp=2 stay within 1.6e-7 of each other (at the default 3e-3 the
# reduction order alone grows to 2e-5), so a 1e-5 gap means the resize lost or repeated something
ARGS = [*TINY, "parallel.global_batch_size=12", "zero=stage1", f"train.max_steps={STEPS}", "train.save_interval=1",
        "train.keep_checkpoints=2", "train.eval_interval=0", "train.collective_timeout_s=60", "optim.lr=3e-4"]
# The GCS marks a node dead after health_check_failure_threshold failed checks, one every
# health_check_period_ms (Ray's defaults: 5 x 3 s). A killed raylet refuses each check at once, so
# this finds it dead in ~3 s; the generous timeout keeps a live raylet on a busy host from being
# declared dead for answering slowly.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                   "RAY_health_check_timeout_ms": "5000", "RAY_health_check_initial_delay_ms": "1000"}
# Ray Train's restart after the node loss counts the workers that fit from the AutoscalingCoordinator's
# view of the cluster, which refreshes every 20 s: until then it still sees room for 3, and the start
# of a 3-worker group waits RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s by default) for a placement
# that cannot come before it counts again (measured here, from the kill to dp=2: 76 s with Ray's
# defaults, 18 s with these two settings).
# The driver passes it to Ray Train's controller.
START_TIMEOUT = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"}


def _ray_env(**extra: str) -> dict[str, str]:
    """A Ray cluster's or job's environment here (test_ray_launcher.py: the workers' niceness 0, and
    the token authentication of Ray 2.5x's clusters, Ray's side services off)."""
    return {**cli_env(), "OMP_NUM_THREADS": "1", "RAY_worker_niceness": "0", "RAY_AUTH_MODE": "token", **LEAN_RAY,
            **extra}


@contextmanager
def _two_node_cluster() -> Iterator[tuple[str, Path, Path]]:
    """A head with 2 CPUs and a second raylet with 1 joined to it, each in a temp dir of its own
    (short: Ray's socket paths under it must stay within 107 bytes); (address, head's dir, second
    node's dir). Also keeps /tmp/ray/ray_current_cluster, which a plain ray.init() joins, untouched."""
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    root = Path(tempfile.mkdtemp(prefix="mfray-"))
    head, node = root / "head", root / "node2"
    port = free_port()
    # RAY_ADDRESS: the processes that look their cluster up on their own (Ray Train's placement-group
    # cleaner) find this one, not "multiple active Ray instances" while another test file's runs
    env = _ray_env(**FAST_NODE_DEATH, RAY_ADDRESS=f"127.0.0.1:{port}")
    common = ["--disable-usage-stats", "--object-store-memory=200000000"]
    try:
        for args in (["--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={head}"],
                     [f"--address=127.0.0.1:{port}", "--num-cpus=1", f"--temp-dir={node}"]):
            started = subprocess.run([ray_cli, "start", *args, *common], env=env, capture_output=True, text=True,
                                     timeout=300)
            assert started.returncode == 0, (started.stdout + started.stderr)[-3000:]
        yield f"127.0.0.1:{port}", head, node
    finally:
        kill_processes(processes_of(root))
        shutil.rmtree(root, ignore_errors=True)


def _records(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError):  # read while rank 0 appends
        return []


def _trained(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


def _controller_lines(head: Path) -> str:
    """Ray Train's controller log (its restarts and resize decisions), for a failure's message."""
    lines = []
    for path in sorted(head.glob("session_latest/logs/train/ray-train-sys-controller-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("levelname") != "DEBUG":
                lines.append(f"{record.get('asctime')} {record.get('message', '')[:300]}")
    return "\n".join(lines[-40:])


def test_a_ray_elastic_job_that_loses_a_node_goes_on_at_dp2(tmp_path):
    whole, run = tmp_path / "whole", tmp_path / "elastic"
    assert_ok(run_cli([*ARGS, f"hydra.run.dir={whole}"]))  # one rank, uninterrupted

    with _two_node_cluster() as (address, head, node), open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen(
            [sys.executable, "-m", "megaframe.train", *ARGS, "launcher=ray", f"launcher.ray_address={address}",
             "launcher.min_nodes=1", "launcher.nodes=3", "cluster.gpus_per_node=1", "launcher.max_failures=3",
             "launcher.resize_interval_s=5", f"hydra.run.dir={run}"],
            cwd=REPO, env=_ray_env(**START_TIMEOUT), stdout=log, stderr=subprocess.STDOUT)
        story = lambda: (f"--- job\n{(tmp_path / 'job.log').read_text()[-3000:]}\n--- Ray Train's controller\n"
                         f"{(tmp_path / 'controller.log').read_text()}")
        try:
            try:
                deadline = time.monotonic() + 300
                while not any(r["step"] >= 5 and r["dp"] == 3 for r in _trained(_records(run))):
                    assert job.poll() is None and time.monotonic() < deadline, "no step 5 at dp=3"
                    time.sleep(0.1)
                lost = kill_processes(processes_of(node))  # the node is lost: its raylet, its rank, the rest of it
                assert any("RayTrainWorker" in name for name in lost), lost  # it hosted one of the 3 ranks
                assert job.wait(timeout=400) == 0
            finally:
                if job.poll() is None:
                    kill_processes(process_tree(job.pid))
                    job.wait()
                # the cluster's logs go with it: keep its controller's for the messages (none alive:
                # something else stopped the whole cluster)
                (tmp_path / "controller.log").write_text(
                    f"{_controller_lines(head)}\n(head processes alive: {len(processes_of(head))})")
        except BaseException as err:
            raise AssertionError(f"{err!r}\n{story()}") from err

    records = _records(run)
    trained = _trained(records)
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1)), story()  # each step once
    sizes = [r["dp"] for r in trained]
    changes = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert changes == [3, 2], (sizes, story())
    assert all(r["world_size"] == r["dp"] for r in trained)
    resized = [r for r in records if r.get("event") == "resized"]
    first_at_dp2 = sizes.index(2) + 1
    assert [(r["step"], r["previous_dp"], r["dp"]) for r in resized] == [(first_at_dp2, 3, 2)], resized
    reference = {r["step"]: r["loss"] for r in _trained(read_metrics(whole))}
    worst = max(abs(r["loss"] - reference[r["step"]]) for r in trained)
    assert worst <= 1e-5 and all(math.isfinite(r["loss"]) for r in trained), worst
