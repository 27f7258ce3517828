"""Joining the process group (megaframe/parallel/rendezvous.py): every rank counted in on the store
before init_process_group, one waiting line naming the missing ranks, a join timeout of its own
(exit 7, RankHung), and a signal that ends a waiting rank at once."""
from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megaframe.backends.common import free_port
from megaframe.common.failures import ExitCode
from megaframe.training import stop_signal
from megaframe.parallel.rendezvous import (JoinTimeout, LaunchEnvError, _connect, _missing, join_world,
                                           wait_for_world)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


def _client(host: dist.TCPStore) -> dist.TCPStore:
    """A rank's own connection to the store (one client's requests, a wait among them, go one at a time)."""
    return dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))


def test_a_complete_world_joins(capsys):
    host, world = _store(), 3
    stores = [_client(host) for _ in range(world)]
    joined = []
    threads = [threading.Thread(target=lambda r=rank: (wait_for_world(stores[r], "j/", r, world, 30,
                                                                      time.monotonic() + 30),
                                                      joined.append(r))) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(joined) == [0, 1, 2]
    assert capsys.readouterr().err == ""  # nobody waited long enough to say so


def test_missing_ranks_are_named_once_then_the_wait_ends_with_exit_7(capsys):
    store, world = _store(), 4
    # rank 0 arrives first (so it speaks), rank 2 a moment later, ranks 1 and 3 never
    threading.Timer(0.1, lambda: (store.set("j/rank2", "1"), store.add("j/count", 1))).start()
    start = time.monotonic()
    with pytest.raises(JoinTimeout) as err:
        wait_for_world(store, "j/", 0, world, 1.0, time.monotonic() + 1.0)
    assert 1.0 <= time.monotonic() - start < 10
    assert err.value.exit_code == ExitCode.RANK_HUNG and not err.value.quiet  # the first to arrive speaks
    assert str(err.value).startswith("2 of 4 ranks did not join within train.join_timeout_s=1 (ranks 1, 3): ")
    assert capsys.readouterr().err.splitlines() == [
        "megaframe: waiting for 2 of 4 ranks to join (ranks 1, 3; giving up after train.join_timeout_s=1)"]


def test_a_rank_that_arrives_later_leaves_the_line_to_the_first():
    store = _store()
    store.set("j/rank0", "1")
    store.add("j/count", 1)
    with pytest.raises(JoinTimeout) as err:
        wait_for_world(store, "j/", 1, 3, 0.5, time.monotonic() + 0.5)
    assert err.value.quiet
    _client(store).set("j/done", "1")  # ends its waiting thread (which holds `store`), as an exit would


class _Counted:
    """A store that counts the requests made through it, by kind."""

    def __init__(self, store):
        self.store, self.calls = store, {}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.store, name)(*args)
        return call


class _Keys:
    """An in-memory store holding the keys of the ranks that arrived."""

    def __init__(self, world: int, absent: set[int]):
        self.keys = {f"j/rank{rank}" for rank in range(world) if rank not in absent}

    def check(self, keys: list[str]) -> bool:
        return all(key in self.keys for key in keys)


def test_naming_the_missing_ranks_of_a_large_world_takes_few_requests():
    """It used to check every rank's key, one request each: 10k requests on rank 0's store."""
    store = _Counted(_Keys(10_000, {17, 9001}))
    assert _missing(store, "j/", 10_000) == [17, 9001] and store.calls["check"] <= 2 * 2 * 14 + 1
    store = _Counted(_Keys(10_000, set(range(100, 10_000, 7))))  # 1,415 missing: the first 8 are named
    assert _missing(store, "j/", 10_000) == list(range(100, 150, 7)) and store.calls["check"] <= 8 * 2 * 14 + 1


def test_a_waiting_rank_waits_for_the_last_without_polling_the_store():
    """Every waiting rank used to poll the count every 0.25 s: 40k requests a second on rank 0's store
    for 10k ranks. Now the last to arrive wakes the others, which wait in one request each."""
    host = _store()
    clients = [_Counted(_client(host)) for _ in range(3)]
    ended = {}

    def rank(r):
        wait_for_world(clients[r], "j/", r, 3, 30, time.monotonic() + 30)
        ended[r] = time.monotonic()

    first = threading.Thread(target=rank, args=(0,))
    first.start()  # rank 0 arrives first: it alone may speak, and only after min(30, timeout/2)
    time.sleep(0.2)
    waiting = threading.Thread(target=rank, args=(1,))
    waiting.start()
    time.sleep(2.5)
    last_arrives = time.monotonic()
    rank(2)
    for thread in (first, waiting):
        thread.join(timeout=30)
    assert sorted(ended) == [0, 1, 2] and max(ended.values()) - last_arrives < 0.9  # within one wait
    assert clients[1].calls == {"set": 1, "add": 1, "wait": 1}  # its key, its count, one wait for `done`
    assert clients[2].calls == {"set": 2, "add": 1}  # its key, its count, and `done`
    # the first to arrive speaks for all: it alone looks for `done`, 4 times a second, and reads no count
    assert clients[0].calls["add"] == 1 and clients[0].calls["check"] <= 4 * 3 + 2


def test_without_rank_0_the_others_give_up_naming_its_address(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    port = free_port()  # nothing listens there
    with pytest.raises(JoinTimeout) as err:
        _connect("127.0.0.1", port, 1, 2, 1.0, time.monotonic() + 1.0)
    assert str(err.value).startswith(f"rank 0 did not start the rendezvous at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} "
                                     "within train.join_timeout_s=1")
    assert capsys.readouterr().err.splitlines() == [
        f"megaframe: waiting for rank 0 of 2 to start the rendezvous at 127.0.0.1:{port} "
        "(giving up after train.join_timeout_s=1)"]  # no C++ connect errors on the terminal


class _Ended(Exception):
    """Raised where stop_signal._exit_now would end the process."""


def test_a_signal_ends_a_waiting_rank_at_once(monkeypatch):
    """The wait polls in short calls, so the handler runs at once; torch's join waited in C++ for
    train.collective_timeout_s, deaf to SIGTERM."""
    def ended(signum, why):
        raise _Ended(signum, why)
    monkeypatch.setattr(stop_signal, "_exit_now", ended)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    stop = stop_signal.StopSignal(2).install()
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    try:
        with pytest.raises(_Ended) as err, stop.joining():
            join_world("gloo", None, 5)
    finally:
        stop.restore()
    assert time.monotonic() - start < 5 and not dist.is_initialized()
    assert err.value.args == (signal.SIGTERM, "while waiting for the ranks to join: stopping now (nothing to save yet)")


def test_a_world_of_one_set_by_hand_gets_an_address_to_join(monkeypatch):
    """RANK=0 WORLD_SIZE=1 without MASTER_ADDR/MASTER_PORT: torch's env:// join raised a traceback."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert join_world("gloo", None, 5) is False  # the engine's own init then joins the world of one
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and 0 < int(os.environ["MASTER_PORT"]) < 65536


@pytest.mark.parametrize("port", ["29557", "99999", "abc"])
def test_a_world_of_one_joins_on_this_host_whatever_address_is_left_in_the_environment(monkeypatch, port):
    """A MASTER_ADDR that does not resolve kept torch's store retrying forever, deaf to SIGTERM; a
    MASTER_PORT out of range ended in a ValueError naming no variable. A world of one meets itself."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "nonexistent.invalid",
                        "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert join_world("gloo", None, 5) is False
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and 0 < int(os.environ["MASTER_PORT"]) < 65536


def test_a_master_addr_that_does_not_resolve_is_one_line_at_once(monkeypatch):
    """torch's store retried it until the collective timeout: C++ stack dumps and a timeout's blame.
    The resolver's answer is planted (a host whose nameserver cannot be reached answers "try again",
    which is asked again until the join deadline: the second case)."""
    import socket

    answers = []

    def resolver(code):
        def getaddrinfo(host, *args, **kwargs):
            answers.append(host)
            raise socket.gaierror(code, "Name or service not known" if code == socket.EAI_NONAME else "Try again")
        return getaddrinfo
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "nonexistent.invalid",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", resolver(socket.EAI_NONAME))
    with pytest.raises(LaunchEnvError) as err:
        join_world("gloo", None, 60)
    assert answers == ["nonexistent.invalid"] and err.value.exit_code == ExitCode.REFUSED  # at once, no retry
    assert str(err.value).startswith("MASTER_ADDR=nonexistent.invalid does not resolve (Name or service not known)")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(socket, "getaddrinfo", resolver(socket.EAI_AGAIN))
    start = time.monotonic()
    with pytest.raises(LaunchEnvError, match="does not resolve \\(Try again\\)"):
        join_world("gloo", None, 1)
    assert len(answers) > 2 and 1 <= time.monotonic() - start < 10  # asked again until the deadline


def test_contradicting_variables_are_refused_before_any_store(monkeypatch):
    for name, value in {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchEnvError) as err:
        join_world("gloo", None, 5)
    assert err.value.exit_code == ExitCode.REFUSED and str(err.value).startswith("RANK=2 must be in [0, WORLD_SIZE=2)")


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_binds_the_group_to_the_ranks_device_and_gloo_to_none(backend, monkeypatch):
    """Under NCCL the join passes this rank's device (set before the join) as device_id: the default
    communicator is made at once and later groups are split from it; gloo gets none (torch refuses a
    CPU device_id)."""
    import torch

    from megaframe.parallel import rendezvous

    joined = {}
    monkeypatch.setattr(rendezvous.dist, "init_process_group",
                        lambda backend, **kw: joined.update(backend=backend, **kw))
    monkeypatch.setattr(rendezvous, "_resolve", lambda *a: None)
    monkeypatch.setattr(rendezvous, "_connect", lambda *a: _store())
    monkeypatch.setattr(rendezvous, "wait_for_world", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # what set_device chose for this rank
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert join_world(backend, timedelta(seconds=60), 10.0)
    assert joined["backend"] == backend and joined["rank"] == 1 and joined["world_size"] == 2
    assert joined["device_id"] == (torch.device("cuda", 3) if backend == "nccl" else None)
