"""Epoch orders shared through data.cache_dir (megaframe/data/epoch_orders.py): bitwise the in-memory
order, built once by the processes of a host that ask at once, mapped rather than held, and a cache
that is damaged or cannot be written changes nothing but memory."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from megaframe.data import epoch_orders
from megaframe.data.dataset import build_epoch_permutation, global_batch_indices
from megaframe.data.epoch_orders import EpochOrders

N = 1000  # samples; shared_from=1 sends every order through the file


@pytest.mark.parametrize("stream", [0, 3])
def test_an_order_through_the_file_is_the_in_memory_order_mapped_read_only(tmp_path, stream, monkeypatch):
    orders = EpochOrders(tmp_path, shared_from=1)
    order = orders(7, 2, N, stream)
    _settled(orders)
    assert isinstance(order, np.memmap) and not order.flags.writeable
    np.testing.assert_array_equal(order, build_epoch_permutation(7, 2, N, stream))
    assert order.dtype == np.int32
    name = f"order-{epoch_orders.FORMAT}-n{N}-seed7-stream{stream}-epoch2.npy"
    assert name in [p.name for p in tmp_path.glob("*.npy")]
    written = os.stat(order.filename)
    # another process (a later run) maps the same file: nothing new is built or written
    monkeypatch.setattr(epoch_orders, "build_epoch_permutation", lambda *a, **k: pytest.fail("built again"))
    again = EpochOrders(tmp_path, shared_from=1)(7, 2, N, stream)
    assert isinstance(again, np.memmap) and again.filename == order.filename
    now = os.stat(again.filename)
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert oct(written.st_mode & 0o777) == oct(0o644)  # other users of a shared cache read it


@pytest.fixture(autouse=True)
def _no_thread_outlives_its_test():
    """A build ahead left running would call what the next test patches."""
    yield
    for thread in threading.enumerate():
        if thread.name == "megaframe-next-epoch-order":
            thread.join(60)


def _settled(orders: EpochOrders) -> None:
    """The next epochs' orders built on threads (EpochOrders._prefetch), done."""
    for thread in orders.prefetches:
        thread.join(60)
        assert not thread.is_alive()


def test_the_next_epochs_order_is_built_ahead_once_most_of_this_one_is_taken(tmp_path, monkeypatch):
    """Its shuffle would otherwise stall the step that crosses into it, on every rank of the host; a
    run that ends early in its epoch (most pre-training runs never finish one) builds nothing ahead."""
    orders = EpochOrders(tmp_path, shared_from=1)
    global_batch_indices(0, 48, N, 6, orders)
    global_batch_indices(17, 48, N, 6, orders)  # up to sample 864 of 1000: not yet
    _settled(orders)
    assert orders.prefetches == [] and not orders.path(6, 1, N, 0).exists()
    global_batch_indices(18, 48, N, 6, orders)  # up to 912: past 90%
    _settled(orders)
    assert [thread.name for thread in orders.prefetches] == ["megaframe-next-epoch-order"]
    built = []

    def refused(*args, **kwargs):
        built.append((args[1], threading.current_thread().name))
        raise RuntimeError("no shuffle here")

    monkeypatch.setattr(epoch_orders, "build_epoch_permutation", refused)
    np.testing.assert_array_equal(global_batch_indices(20, 48, N, 6, orders), global_batch_indices(20, 48, N, 6))
    assert built == []  # the step into epoch 1 built nothing
    orders.reached(6, 1, N, 0, N)  # epoch 2's build ahead fails quietly: the step that needs it says why
    _settled(orders)
    assert built == [(2, "megaframe-next-epoch-order")] and not orders.path(6, 2, N, 0).exists()


def test_step_indices_through_the_file_are_those_in_memory(tmp_path):
    orders = EpochOrders(tmp_path, shared_from=1)
    for step in (0, 3, 41):  # 41 x 48 crosses from epoch 1 into epoch 2
        np.testing.assert_array_equal(global_batch_indices(step, 48, N, 5, orders),
                                      global_batch_indices(step, 48, N, 5))
    _settled(orders)
    assert len(list(tmp_path.glob("*.npy"))) == 3  # epochs 0-2 (2 built ahead once step 41 finished 1)


def test_below_the_threshold_or_without_a_directory_nothing_is_written(tmp_path):
    order = EpochOrders(tmp_path, shared_from=N + 1)(1, 0, N)
    assert not isinstance(order, np.memmap) and not list(tmp_path.iterdir())
    np.testing.assert_array_equal(EpochOrders(None, shared_from=1)(1, 0, N), order)


def _ask(directory: str, counts: str, out: str) -> None:
    built = epoch_orders.build_epoch_permutation

    def counted(*args, **kwargs):
        with open(counts, "a") as log:
            log.write(f"{os.getpid()} epoch {args[1]}\n")
        time.sleep(0.5)  # long enough for the other process to ask while this one builds
        return built(*args, **kwargs)

    epoch_orders.build_epoch_permutation = counted  # this forked process only
    orders = EpochOrders(Path(directory), shared_from=1)
    order = orders(4, 1, N)
    _settled(orders)  # epoch 2's thread, before this process exits
    np.save(out, order)


def test_processes_that_ask_at_once_build_the_order_once(tmp_path):
    context = multiprocessing.get_context("fork")
    counts = tmp_path / "builds"
    processes = [context.Process(target=_ask, args=(str(tmp_path / "orders"), str(counts), str(tmp_path / f"{i}.npy")))
                 for i in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    assert len([line for line in counts.read_text().splitlines() if line.endswith(" epoch 1")]) == 1
    for i in range(3):
        np.testing.assert_array_equal(np.load(tmp_path / f"{i}.npy"), build_epoch_permutation(4, 1, N))
    assert not list((tmp_path / "orders").glob(".*.tmp"))


@pytest.mark.parametrize("damage", ["truncated", "another shape", "not npy", "empty", "zeros", "out of range",
                                    "a sample twice"])
def test_a_damaged_file_is_rebuilt_not_read(tmp_path, damage):
    """Zeros of the right shape trained every step on sample 0, exit 0; 2^30 was an IndexError, exit 1."""
    orders = EpochOrders(tmp_path, shared_from=1)
    path = orders.path(9, 0, N, 0)
    if damage in ("zeros", "out of range", "a sample twice"):
        edited = build_epoch_permutation(9, 0, N).copy()
        if damage == "zeros":
            edited[:] = 0
        elif damage == "out of range":
            edited[17] = 2**30
        else:
            edited[5], edited[6] = edited[5] + 1, edited[6] - 1
        np.save(path, edited)
    elif damage == "truncated":
        np.save(path, build_epoch_permutation(9, 0, N))
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "another shape":
        np.save(path, np.arange(N - 1, dtype=np.int32))
    elif damage == "not npy":
        path.write_text("hello")
    else:
        path.write_bytes(b"")
    np.testing.assert_array_equal(orders(9, 0, N), build_epoch_permutation(9, 0, N))
    np.testing.assert_array_equal(np.load(path), build_epoch_permutation(9, 0, N))


def test_a_partial_file_a_killed_writer_left_is_removed_once_its_writer_is_gone(tmp_path):
    """The temp file of a writer on this host that is gone (killed mid-write: a rank, or a build ahead
    ended with its process) is removed by the next build; a live writer's is not (temp_files.py)."""
    import subprocess

    from megaframe.data.temp_files import host_tag

    orders = EpochOrders(tmp_path, shared_from=1)
    path = orders.path(3, 0, N, 0)
    ended = subprocess.Popen(["true"])
    ended.wait()
    stale = tmp_path / f".{path.name}.order.{host_tag()}-{ended.pid}.abcd1234.tmp"
    fresh = tmp_path / f".{path.name}.order.{host_tag()}-{os.getppid()}.abcd1234.tmp"  # a live writer
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"x" * 100)
    orders(3, 0, N)
    assert not stale.exists() and fresh.exists()


def test_a_full_disk_uses_the_order_it_built_and_says_so(tmp_path, monkeypatch, capsys):
    """The write fails (ENOSPC): the order built under the lock is returned, not built again at once,
    nothing is left behind, and later calls go to the in-memory cache without trying the disk again."""
    built = []
    real = epoch_orders.build_epoch_permutation

    def counted(*args, **kwargs):
        built.append(args)
        return real(*args, **kwargs)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(epoch_orders, "build_epoch_permutation", counted)
    monkeypatch.setattr(epoch_orders.np, "save", full)
    orders = EpochOrders(tmp_path, shared_from=1)
    np.testing.assert_array_equal(orders(8, 0, N + 1), real(8, 0, N + 1))
    np.testing.assert_array_equal(orders(8, 0, N + 1), real(8, 0, N + 1))
    assert len(built) == 1 and not list(tmp_path.glob("*.npy")) and not list(tmp_path.glob(".*.tmp"))
    assert "No space left on device" in capsys.readouterr().err


def test_a_cache_that_cannot_be_written_keeps_the_order_in_memory_and_says_so_once(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be: mkdir fails (as a read-only cache would)
    orders = EpochOrders(blocked / "orders", shared_from=1)
    for epoch in (0, 1):
        np.testing.assert_array_equal(orders(2, epoch, N), build_epoch_permutation(2, epoch, N))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot share epoch orders" in err and "data.cache_dir" in err, err


def test_the_training_set_shares_its_orders_through_data_cache_dir(tmp_path, monkeypatch):
    """build_data hands the training set (and a blend's) orders under data.cache_dir/orders."""
    from megaframe.config.compose import compose
    from megaframe.training.data_setup import build_data

    monkeypatch.setattr(epoch_orders, "SHARED_FROM", 1)
    cfg, _ = compose([f"data.cache_dir={tmp_path}", "model.seq_length=32"])
    splits = build_data(cfg.data, cfg.model.seq_length)
    np.testing.assert_array_equal(splits.train.step_indices(2, 8, 1234),
                                  global_batch_indices(2, 8, splits.train.num_samples, 1234))
    _settled(splits.train.orders)
    assert list((tmp_path / "orders").glob("order-*.npy"))


def test_the_orders_bench_measures_both_ways_and_leaves_nothing(tmp_path):
    """tools/bench_orders.py, whose figures BENCHMARKS.md cites ("Epoch orders shared by a host's ranks")."""
    import re
    import subprocess
    import sys

    from tests.support.helpers import REPO, cli_env

    result = subprocess.run([sys.executable, "tools/bench_orders.py", "--samples", "100000", "--ranks", "2"],
                            cwd=REPO, env=cli_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ways = re.findall(r"^(own order|shared file): 100,000 samples, 2 processes: first step [\d.]+ s \(slowest\), "
                      r"PSS \d+ MiB per process, \d+ MiB in all; the step into the next epoch [\d.]+ s$",
                      result.stdout, re.M)
    assert ways == ["own order", "shared file"], result.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_next_orders_of_several_sources_are_built_one_at_a_time(tmp_path, monkeypatch):
    """A blend's sources all start their first epoch at step 0; their next orders built at once would
    hold the whole set's orders in memory together."""
    running, most = [0], [0]
    lock = threading.Lock()
    real = epoch_orders.build_epoch_permutation

    def watched(*args, **kwargs):
        if threading.current_thread().name != "megaframe-next-epoch-order":
            return real(*args, **kwargs)  # this epoch's, on the step's thread
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(epoch_orders, "build_epoch_permutation", watched)
    orders = EpochOrders(tmp_path, shared_from=1)
    for stream in range(1, 5):
        orders(1, 0, N, stream)
        orders.reached(1, 0, N, stream, N)
    _settled(orders)
    assert len(orders.prefetches) == 4 and most[0] == 1
    assert all(orders.path(1, 1, N, stream).exists() for stream in range(1, 5))


def test_a_user_without_a_home_directory_trains_data_path_with_orders_in_memory(tmp_path, monkeypatch):
    """data.path needs no cache (the demo corpus does): a container's user without a home directory
    trains it, its orders in memory, as before there was a shared one."""
    from pathlib import Path as RealPath

    from megaframe.config.compose import compose
    from megaframe.training.data_setup import _orders

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(RealPath, "home", staticmethod(no_home))
    cfg, _ = compose(["data.path=/nowhere/corpus"])
    assert _orders(cfg.data).directory is None


def _hold_forever(ready) -> None:
    ready.set()
    time.sleep(60)


def test_a_child_forked_while_an_order_is_built_does_not_keep_the_hosts_lock(tmp_path):
    """A process forked while this one builds an order under the host lock (a build-ahead thread's)
    does not hold that lock once the build is done: another process takes it at once."""
    import fcntl

    context = multiprocessing.get_context("fork")
    lock = tmp_path / "order.lock"
    ready, child = context.Event(), None
    try:
        with epoch_orders._host_lock(lock):
            child = context.Process(target=_hold_forever, args=(ready,))
            child.start()
            assert ready.wait(30)
        other = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if the child holds it
        finally:
            os.close(other)
    finally:
        if child is not None:
            child.kill()
            child.join()


def test_publishing_a_missing_order_never_unlinks_its_name(tmp_path, monkeypatch):
    """Every host builds the next epoch's order at once: one that found the name missing and then
    unlinked it before linking its own would remove the file another host published in between,
    under the ranks mapping it. Only a damaged file is unlinked."""
    unlinked = []
    real = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, *a, **k: unlinked.append(self.name) or real(self, *a, **k))
    path = tmp_path / "order-n10.npy"
    epoch_orders._publish(path, build_epoch_permutation(1, 0, 10))
    assert path.name not in unlinked and epoch_orders._load(path, 10) is not None
    path.unlink()
    path.write_bytes(b"damaged")
    unlinked.clear()
    epoch_orders._publish(path, build_epoch_permutation(1, 0, 10))
    assert path.name in unlinked and epoch_orders._load(path, 10) is not None
