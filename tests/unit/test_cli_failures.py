"""How megaframe-train names a rank that a signal killed, from the failures torch's agent reports."""
from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megaframe.launch.local import name_a_killed_rank as _name_a_killed_rank

OOM_LINE = ("megaframe-train: error (rank {rank}): killed by SIGKILL (the kernel's OOM killer sends it when memory "
            "runs out: see `dmesg`) [exit 1]")


def _failed(tmp_path, *ranks: tuple[int, int]) -> ChildFailedError:
    """(exit code, second) per rank, as the agent reports ranks that wrote no error file."""
    failures = {}
    for rank, (exitcode, second) in enumerate(ranks):
        failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                                 error_file=str(tmp_path / f"none-{rank}.json"))
        failure.timestamp = second
        failures[rank] = failure
    return ChildFailedError("megaframe.train", failures)


@pytest.mark.parametrize("ranks, named", [
    # the peer that failed on the killed rank's broken connection shares its second (CI saw this)
    (((1, 100), (-signal.SIGKILL, 100)), 1),
    (((-signal.SIGKILL, 100), (1, 100)), 0),
    (((1, 101), (-signal.SIGKILL, 100)), 1),
    # the agent's SIGTERM to the survivors in the same second is not the cause
    (((-signal.SIGTERM, 100), (-signal.SIGKILL, 100)), 1),
    # a rank that printed its error and exited 1, and a peer that aborted in the same second: the
    # abort is not named over it (the kernel's SIGKILL is the one death without a word)
    (((1, 100), (-signal.SIGABRT, 100)), None),
    # a rank that exited with a code first said why itself; a kill seconds later was the agent's
    (((1, 100), (-signal.SIGKILL, 130)), None),
    (((3, 100), (1, 100)), None),
])
def test_the_rank_a_signal_killed_is_named(tmp_path, capsys, ranks, named):
    _name_a_killed_rank(_failed(tmp_path, *ranks))
    printed = capsys.readouterr().err.strip()
    assert printed == ("" if named is None else OOM_LINE.format(rank=named))


def test_a_real_time_signal_is_named_by_its_number(tmp_path, capsys):
    _name_a_killed_rank(_failed(tmp_path, (-(signal.SIGRTMIN + 2), 100), (1, 101)))
    assert capsys.readouterr().err.strip() == (
        f"megaframe-train: error (rank 0): killed by signal {signal.SIGRTMIN + 2} [exit 1]")


def test_a_sigterm_is_named_only_when_it_came_first(tmp_path, capsys):
    _name_a_killed_rank(_failed(tmp_path, (1, 101), (-signal.SIGTERM, 100)))
    assert capsys.readouterr().err.strip() == "megaframe-train: error (rank 1): killed by SIGTERM [exit 1]"
    _name_a_killed_rank(_failed(tmp_path, (1, 100), (-signal.SIGTERM, 100)))  # the agent's, after rank 0's error
    assert capsys.readouterr().err.strip() == ""


class _Ended(Exception):
    """Raised where stop_signal._exit_now would end the process."""


def test_a_rank_waiting_to_join_under_a_launcher_ends_on_a_signal_with_its_code(monkeypatch):
    """Under torchrun or srun (run dir not pinned) the join happens in launch/torchrun.shared_run_dir, before
    the Trainer: SIGUSR1/SIGTERM/SIGHUP used to end that waiting rank by the default action, no line."""
    import os
    import time
    from types import SimpleNamespace

    from megaframe.launch import torchrun
    from megaframe.training import stop_signal

    def ended(signum, why):
        raise _Ended(signum, why)

    class Waiting:  # an engine whose join waits for a rank that never comes
        def init_distributed(self, *_):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(3)

    monkeypatch.setattr(stop_signal, "_exit_now", ended)
    monkeypatch.setattr(torchrun, "engine", lambda name: Waiting())
    cfg = SimpleNamespace(backend=SimpleNamespace(name="any"),
                          train=SimpleNamespace(collective_timeout_s=60, join_timeout_s=60))
    def missed(*_):  # a signal the join missed must not end pytest
        pass

    before = signal.signal(signal.SIGUSR1, missed)
    try:
        with pytest.raises(_Ended) as err:
            torchrun.shared_run_dir("runs/x", cfg)
        assert err.value.args == (signal.SIGUSR1, "while waiting for the ranks to join: stopping now "
                                                  "(nothing to save yet)")
        assert stop_signal.exit_code(signal.SIGUSR1) == 138
        assert signal.getsignal(signal.SIGUSR1) is missed  # the previous handler is put back
    finally:
        signal.signal(signal.SIGUSR1, before)
