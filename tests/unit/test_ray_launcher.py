"""megaframe/launch/ray.py without Ray: the job's exit code from what Ray reports."""
from __future__ import annotations

from megaframe.launch.ray import _exit_code


class WorkerGroupError(Exception):
    """The shape of Ray Train 2.5x's error: each failed worker's exception by rank."""

    def __init__(self, worker_failures: dict):
        super().__init__("Training failed due to worker errors")
        self.worker_failures = worker_failures


def test_the_documented_cause_wins_over_the_ranks_that_followed_it():
    assert _exit_code(WorkerGroupError({0: SystemExit(1), 1: SystemExit(7)})) == 7
    assert _exit_code(WorkerGroupError({1: SystemExit(4)})) == 4


def test_a_code_chained_as_a_cause_is_found():
    wrapped = RuntimeError("worker failed")
    wrapped.__cause__ = SystemExit(3)
    assert _exit_code(wrapped) == 3


def test_a_failure_no_rank_explained_is_exit_1():
    assert _exit_code(WorkerGroupError({0: RuntimeError("actor died")})) == 1
    assert _exit_code(RuntimeError("the Ray cluster went away")) == 1


def test_a_cluster_address_is_host_and_port():
    """launcher.ray_address checked before Ray is asked: a malformed one is one line naming the key
    and the forms it takes; no address or `auto` is left to Ray."""
    from megaframe.launch.ray import unreachable_cluster

    assert unreachable_cluster(None) is None and unreachable_cluster("auto") is None
    for bad in ("headnode", "ray://headnode", "headnode:port"):
        assert unreachable_cluster(bad) == f"launcher.ray_address={bad} is not HOST:PORT, ray://HOST:PORT or auto"
