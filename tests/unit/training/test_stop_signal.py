"""The first SIGINT/SIGTERM/SIGHUP/SIGUSR1 only raises a flag; a rank that then never reaches a step boundary (hung,
or stopped by torchrun's agent because a peer failed) still ends, within its grace."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.support.helpers import REPO
from megaframe.training import stop_signal

_NO_BOUNDARY = """
import os, signal, time
from megaframe.training import stop_signal
stop_signal.GRACE_FLOOR_S = 0.5
stop = stop_signal.StopSignal(1).install()
stop.note_step(0.01)
os.kill(os.getpid(), signal.SIGTERM)
print("flagged", stop.received, flush=True)
time.sleep(60)  # a rank stuck outside the loop
"""

_AT_BOUNDARY = """
import os, signal, time, torch
from megaframe.training import stop_signal
stop_signal.GRACE_FLOOR_S = 0.5
stop = stop_signal.StopSignal(1).install()
os.kill(os.getpid(), signal.SIGINT)
print("agreed", stop.agreed(torch.device("cpu")), flush=True)
time.sleep(1.5)  # a save after the boundary: the watchdog no longer runs
print("saved", flush=True)
"""


def _run(code: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    return result, time.monotonic() - start


def test_a_signalled_rank_that_reaches_no_boundary_ends_after_its_grace():
    result, took = _run(_NO_BOUNDARY)
    assert result.stdout.strip() == "flagged 15", result.stderr[-2000:]
    assert result.returncode == 143 and took < 30, (result.returncode, took)


def test_the_boundary_disarms_the_watchdog_so_the_save_can_finish():
    result, _ = _run(_AT_BOUNDARY)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["agreed", "2", "saved"]


class _Exits:
    """Stands in for stop_signal._exit_now: records what would have ended the rank."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def __call__(self, signum: int, why: str, every_rank: bool = False) -> None:
        self.calls.append((signum, why))


@pytest.fixture
def exits(monkeypatch) -> _Exits:
    """What would have ended the rank, recorded instead; a grace of 0.2 s."""
    recorded = _Exits()
    monkeypatch.setattr(stop_signal, "_exit_now", recorded)
    monkeypatch.setattr(stop_signal, "GRACE_FLOOR_S", 0.2)
    return recorded


def test_a_signal_during_a_save_waits_for_it_however_long(exits):
    """SLURM's preemption mid-save used to meet the watchdog (three step times) before the save ended."""
    stop = stop_signal.StopSignal(1).install()
    try:
        stop.note_step(0.01)
        with stop.unguarded():  # a save taking minutes on a GPU cluster, here 0.8 s: four graces
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.8)
        assert exits.calls == []
        assert stop.agreed(torch.device("cpu")) == signal.SIGTERM
        time.sleep(0.4)  # the stop's own save, after the boundary
        assert exits.calls == []
    finally:
        stop.restore()


def test_a_second_signal_during_a_save_ends_the_rank_at_once(monkeypatch):
    exits = _Exits()
    monkeypatch.setattr(stop_signal, "_exit_now", exits)
    monkeypatch.setattr(stop_signal, "SAME_REQUEST_S", 0.1)
    stop = stop_signal.StopSignal(1).install()
    try:
        stop.note_step(0.01)
        with stop.unguarded():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)  # the user means now
        assert exits.calls == [(signal.SIGTERM, "again: stopping now, without saving")]
    finally:
        stop.restore()


@pytest.mark.parametrize("second, ends", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_the_same_signal_at_once_is_one_request_another_is_a_second(second, ends, monkeypatch):
    """SLURM signals every process of the step and torchrun's agent passes its copy on: a rank gets
    SIGTERM twice within moments, one request (tests/e2e/test_signals.py has the real one). Another
    signal at once is still a second one."""
    exits = _Exits()
    monkeypatch.setattr(stop_signal, "_exit_now", exits)
    stop = stop_signal.StopSignal(1).install()
    try:
        stop.note_step(0.01)
        with stop.unguarded():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), second)
        assert exits.calls == ([(second, "again: stopping now, without saving")] if ends else [])
        assert ends or stop.received == signal.SIGTERM  # (a real _exit_now would have ended the rank)
    finally:
        stop.restore()


@pytest.mark.parametrize("signum, code", [(signal.SIGHUP, 129), (signal.SIGUSR1, 138), (signal.SIGTERM, 143)])
def test_sighup_and_sigusr1_stop_like_sigterm(signum, code):
    """What SLURM (--signal=USR1@90) and a closed terminal send before the end used to kill the run unsaved."""
    before = signal.signal(signum, lambda *_: None)  # a signal StopSignal missed must not end pytest
    stop = stop_signal.StopSignal(1).install()
    try:
        os.kill(os.getpid(), signum)
        assert stop.received == signum and stop_signal.exit_code(stop.agreed(torch.device("cpu"))) == code
    finally:
        stop.restore()
        signal.signal(signum, before)


def test_start_up_and_evaluations_are_not_guarded_until_the_step_loop_resumes():
    stop = stop_signal.StopSignal(1).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # start-up: a resume's load can be a save's size
        assert stop._watchdog is None
        with stop.unguarded():
            stop.note_step(0.5)  # a step was timed, but an evaluation runs now
            assert stop._watchdog is None
        assert stop._watchdog is not None  # back in the step loop: the next boundary is owed
        assert stop.agreed(torch.device("cpu")) == signal.SIGTERM and stop._watchdog is None
    finally:
        stop.restore()


def test_a_signal_ignored_at_start_stays_ignored_as_nohup_asks():
    """`nohup megaframe-train ... &` then logging out: SIGHUP used to reach our handler (and the agent's
    --signals-to-handle) and stop the run with 129 where nohup had kept it training."""
    from megaframe.launch import local

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup leaves to the process it starts
    stop = stop_signal.StopSignal(1).install()
    try:
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.received == 0
        assert local.agent_signals() == "SIGTERM,SIGINT,SIGQUIT,SIGUSR1"  # the ranks inherit SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle  # the others are still ours
    finally:
        stop.restore()
        signal.signal(signal.SIGHUP, before)
    if before is not signal.SIG_IGN:  # not itself run under nohup: the full list
        assert local.agent_signals() == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def test_sigquit_ends_the_rank_at_once_without_a_core_dump(monkeypatch):
    """torchrun's agent passes SIGQUIT on by default: each rank dumped core (read as INTERNAL)."""
    exits = _Exits()
    monkeypatch.setattr(stop_signal, "_exit_now", exits)
    before = signal.signal(signal.SIGQUIT, lambda *_: None)  # a SIGQUIT StopSignal missed must not end pytest
    stop = stop_signal.StopSignal(1).install()
    try:
        os.kill(os.getpid(), signal.SIGQUIT)
        assert exits.calls == [(signal.SIGQUIT, "received: stopping now, without saving")]
        assert stop_signal.exit_code(signal.SIGQUIT) == 131
    finally:
        stop.restore()
        signal.signal(signal.SIGQUIT, before)


def test_a_signal_after_the_last_step_waits_for_no_boundary(exits):
    """The loop ended at train.max_steps: the run's last save, W&B and the closing barrier follow,
    minutes at scale, with no boundary to come. The watchdog armed by a signal then ended the rank
    two seconds in, as a hang, in the middle of them."""
    stop = stop_signal.StopSignal(1).install()
    try:
        stop.note_step(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # during the last step
        stop.note_step(0.01)  # its end: the loop is over
        stop.finished()
        with stop.unguarded():  # the last save
            time.sleep(0.5)
        time.sleep(0.5)  # W&B, the closing barrier
        assert exits.calls == []
    finally:
        stop.restore()


def test_the_ray_drivers_request_is_this_ranks_signal_and_arms_nothing_in_a_save(tmp_path, monkeypatch, exits):
    """launcher=ray: the driver writes the signal's number; rank 0's thread takes it as its own
    signal. Taken during a save, it arms no watchdog there (the loop's next step end does); after
    the loop ended it is not taken at all."""
    monkeypatch.setattr(stop_signal, "REQUEST_POLL_S", 0.05)
    request = tmp_path / ".stop_request"
    monkeypatch.setenv(stop_signal.REQUEST_FILE_ENV, str(request))
    stop = stop_signal.StopSignal(1)
    stop.watch_requests()
    stop.note_step(0.01)
    with stop.unguarded():  # a save
        request.write_text("15\n")
        deadline = time.monotonic() + 10
        while not stop.received and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stop.received == signal.SIGTERM
        time.sleep(0.6)  # three graces
    assert exits.calls == []
    assert stop.agreed(torch.device("cpu")) == signal.SIGTERM

    request.unlink()
    late = stop_signal.StopSignal(1)
    late.watch_requests()
    late.finished()
    request.write_text("15\n")  # after the loop ended
    time.sleep(0.3)  # six polls
    assert late.received == 0


@pytest.mark.parametrize("local_rank, says", [(None, True), ("0", True), ("1", False)])
def test_a_line_that_every_rank_would_print_is_local_rank_0s(local_rank, says):
    """A second Ctrl-C reaches every rank through the agent: eight identical lines on a node of eight."""
    import subprocess
    import sys

    from tests.support.helpers import REPO, cli_env

    code = ("import signal; from megaframe.training.stop_signal import _exit_now; "
            "_exit_now(signal.SIGTERM, 'again: stopping now, without saving')")
    env = cli_env(**({"LOCAL_RANK": local_rank} if local_rank else {}))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 143
    said = "megaframe-train: SIGTERM again: stopping now, without saving\n"
    assert result.stderr == (said if says else ""), result.stderr
