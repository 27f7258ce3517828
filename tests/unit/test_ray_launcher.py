"""megaframe/launch/ray.py without Ray: the exit code from what Ray reports, and from a stop the driver asked for."""
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


def _worker_ending(tmp_path, ends, requested: bool) -> None:
    from megaframe.launch import ray as ray_launch

    if requested:
        (tmp_path / ray_launch.STOP_REQUEST_FILE).write_text("15\n")

    def entry(argv):
        if ends is not None:
            raise ends
    ray_launch._worker({"run_dir": str(tmp_path), "overrides": [], "entry": entry})


def test_a_worker_that_stopped_as_the_driver_asked_says_so_and_the_driver_exits_with_the_signal(tmp_path):
    from megaframe.launch import ray as ray_launch

    _worker_ending(tmp_path, SystemExit(143), requested=True)  # a success to Ray: no restart into training
    stopped = (tmp_path / ray_launch.STOPPED_FILE).exists()
    assert stopped and ray_launch.finished_code([15], stopped) == 143


def test_a_signal_after_the_last_step_leaves_the_driver_at_0(tmp_path):
    """The driver took a signal, but the workers' loop had ended: the run is complete, and 143 would
    have marked it failed (torchrun's ranks exit 0 then)."""
    from megaframe.launch import ray as ray_launch

    _worker_ending(tmp_path, None, requested=True)
    stopped = (tmp_path / ray_launch.STOPPED_FILE).exists()
    assert not stopped and ray_launch.finished_code([15], stopped) == 0
    assert ray_launch.finished_code([], False) == 0


def test_a_signal_exit_without_the_drivers_request_is_a_failure_for_ray(tmp_path):
    import pytest

    from megaframe.launch import ray as ray_launch

    with pytest.raises(SystemExit):
        _worker_ending(tmp_path, SystemExit(143), requested=False)
    assert not (tmp_path / ray_launch.STOPPED_FILE).exists()
