"""Joining the process group: the launcher's variables checked first, then a wait for every rank with
a timeout of its own, that a signal can end.

torch's env:// join used to take `RANK >= WORLD_SIZE` and end in C++ stack dumps, and a rank that
never started left the others silent inside gloo's or NCCL's connect for train.collective_timeout_s
(30 min), deaf to SIGTERM (a Python handler runs only between C++ calls). Here each rank checks
RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (`launch_env_problem`), then
counts itself in on the rendezvous store (rank 0's TCPStore at MASTER_ADDR:MASTER_PORT, or torchrun's
agent store) and waits for the last to arrive to say all are in: the first to arrive says
"waiting for N of M ranks to join" once, and after train.join_timeout_s every waiting rank ends with
exit 7 (RankHung). Only a complete world calls init_process_group, on that same store.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megaframe.common.failures import ExitCode, RankHung, RunFailure
from megaframe.common.launch_env import launch_env_problem

_POLL_S = 0.25  # between looks for rank 0's store, and the first rank's for `done`: one rank, 4 a second
_WAIT_MARGIN_S = 5.0  # a quiet rank's wait outlasts its deadline by this: the rank ends first, silently
_NAMED = 8  # missing ranks named in a line, at most


class LaunchEnvError(RunFailure):
    """The launcher's variables contradict each other: refused before joining (exit 2)."""

    exit_code = ExitCode.REFUSED


class JoinTimeout(RankHung):
    """Ranks did not join within train.join_timeout_s. `quiet` on the ranks that leave the line to another."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether something listens at host:port (a plain socket: a TCPStore client that fails to
    connect prints C++ stack traces to stderr at every retry)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _say(line: str) -> None:
    print(f"megaframe: {line}", file=sys.stderr, flush=True)


def _missing(store, prefix: str, world: int) -> list[int]:
    """The ranks (at most _NAMED) that have not counted themselves in yet, found by halving: a range
    whose ranks have all arrived costs one check() of its keys, so naming k missing ranks of a world
    of N takes about 2·k·log2(N) requests, not N (called once, by one rank)."""
    missing: list[int] = []
    ranges = [(0, world)]
    while ranges and len(missing) < _NAMED:
        low, high = ranges.pop()
        if store.check([f"{prefix}rank{rank}" for rank in range(low, high)]):
            continue
        if high - low == 1:
            missing.append(low)
        else:
            middle = (low + high) // 2
            ranges += [(middle, high), (low, middle)]  # the lower half first: ranks named in order
    return missing


def _named(ranks: list[int], absent: int) -> str:
    listed = ", ".join(map(str, ranks))
    return f"rank{'s' if absent > 1 else ''} {listed}{', …' if absent > len(ranks) else ''}"


def free_port() -> int:
    """A TCP port free on this host now (a world of one picks its own rendezvous port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _resolve(host: str, port: int, deadline: float) -> None:
    """MASTER_ADDR resolves, or one line (exit 2) naming it: torch's store retried an unresolvable
    address until the collective timeout, in C++ (stack dumps, and the blame on a collective). A
    resolver that answers "try again" (thousands of ranks asking at once) is asked again until the deadline."""
    while True:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return
        except socket.gaierror as err:
            if err.errno != socket.EAI_AGAIN or time.monotonic() >= deadline:
                raise LaunchEnvError(f"MASTER_ADDR={host} does not resolve ({err.strerror}): set it to rank 0's host "
                                     f"name or address as every rank sees it (torchrun: --master-addr; srun: the "
                                     f"job's first host)") from None
        time.sleep(_POLL_S)


def _connect(host: str, port: int, rank: int, world: int, join_timeout_s: float, deadline: float) -> dist.TCPStore:
    """Rank 0 serves the store; the others connect to it, polling, until the deadline."""
    if rank == 0:
        return dist.TCPStore(host, port, world, is_master=True, timeout=timedelta(seconds=join_timeout_s),
                             wait_for_workers=False)
    said = False
    notice_at = time.monotonic() + min(30.0, join_timeout_s / 2)
    while not _reachable(host, port, _POLL_S):
        now = time.monotonic()
        # rank 0 is not there to count anyone: one line per node (its first rank), not one per rank
        speaks = os.environ.get("LOCAL_RANK", "0") == "0"
        if now >= deadline:
            raise JoinTimeout(f"rank 0 did not start the rendezvous at MASTER_ADDR:MASTER_PORT={host}:{port} within "
                              f"train.join_timeout_s={join_timeout_s:g}: check that rank 0 started (its host, the "
                              f"launcher's log) and that MASTER_ADDR/MASTER_PORT are the same on every rank",
                              quiet=not speaks)
        if not said and now >= notice_at and speaks:
            _say(f"waiting for rank 0 of {world} to start the rendezvous at {host}:{port} "
                 f"(giving up after train.join_timeout_s={join_timeout_s:g})")
            said = True
        time.sleep(_POLL_S)
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    return dist.TCPStore(host, port, world, is_master=False, timeout=left, wait_for_workers=False)


def _count(store, key: str) -> int:
    """The ranks counted in so far. The store's host (rank 0) ending its own wait ends the others'."""
    try:
        return store.add(key, 0)
    except RuntimeError as err:  # DistNetworkError: rank 0 gave up (it says why) or died
        raise _gone(err) from None


def _gone(err: Exception) -> JoinTimeout:
    return JoinTimeout(f"the rendezvous store went away while this rank waited for the others to join ({err})",
                       quiet=True)


def _waiting_for(store, done: str, seconds: float) -> tuple[threading.Event, list]:
    """Wait on a daemon thread, in one request, until the last rank sets `done` (or `seconds` pass):
    the main thread then waits on an Event, which a signal's Python handler interrupts (a handler runs
    only between C++ calls, and the store's timed-out waits print C++ warnings). The list gets the
    store's error, if any."""
    ended, errors = threading.Event(), []

    def wait() -> None:
        try:
            store.wait([done], timedelta(seconds=seconds))
        except RuntimeError as err:  # DistNetworkError: rank 0 gave up or died; DistStoreError: timed out
            errors.append(err)
        ended.set()

    threading.Thread(target=wait, name="megaframe-join", daemon=True).start()
    return ended, errors


def _checked(store, key: str) -> bool:
    try:
        return store.check([key])
    except RuntimeError as err:
        raise _gone(err) from None


def wait_for_world(store, prefix: str, rank: int, world: int, join_timeout_s: float, deadline: float) -> None:
    """Count this rank in on `store` and wait until all `world` ranks are: the last to arrive sets a
    `done` key that the others wait for in one request each. The first rank to arrive speaks for all:
    it looks for `done` every _POLL_S, says once who is missing, and names them if the deadline passes
    (JoinTimeout); only it reads the count and the ranks' keys. Every rank polling the count put
    O(world) requests a second on rank 0's store (40k/s for 10k ranks). A signal ends any of them at
    once (stop_signal.joining)."""
    store.set(f"{prefix}rank{rank}", "1")
    arrived = store.add(f"{prefix}count", 1)
    done = f"{prefix}done"
    if arrived >= world:
        store.set(done, "1")
        return
    if arrived > 1:  # a quiet rank: it waits for `done`, leaving the line to the first
        ended, errors = _waiting_for(store, done, max(0.0, deadline - time.monotonic()) + _WAIT_MARGIN_S)
        if ended.wait(max(0.0, deadline - time.monotonic())) and not errors:
            return
        if errors and not isinstance(errors[0], dist.DistStoreError):
            raise _gone(errors[0])
        raise JoinTimeout(f"not all {world} ranks joined within train.join_timeout_s={join_timeout_s:g}", quiet=True)
    notice_at = time.monotonic() + min(30.0, join_timeout_s / 2)
    said = False
    while not _checked(store, done):
        now = time.monotonic()
        if now >= deadline:
            joined = _count(store, f"{prefix}count")
            raise JoinTimeout(f"{world - joined} of {world} ranks did not join within train.join_timeout_s="
                              f"{join_timeout_s:g} ({_named(_missing(store, prefix, world), world - joined)}): check "
                              "that they started (their hosts, the launcher's log), or raise train.join_timeout_s")
        if not said and now >= notice_at:
            joined = _count(store, f"{prefix}count")
            if joined < world:
                missing = _missing(store, prefix, world)
                _say(f"waiting for {world - joined} of {world} ranks to join ({_named(missing, world - joined)}; "
                     f"giving up after train.join_timeout_s={join_timeout_s:g})")
            said = True
        time.sleep(_POLL_S)


def join_world(backend: str, timeout: Optional[timedelta], join_timeout_s: Optional[float]) -> bool:
    """Join the default process group once every rank has arrived. Returns False (doing nothing)
    when already joined, or for a world of one outside torchrun (the caller's plain init serves)."""
    if dist.is_initialized():
        return False
    if problem := launch_env_problem():
        raise LaunchEnvError(problem)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    agent_store = attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if world == 1 and not agent_store:
        # RANK=0 WORLD_SIZE=1 by hand: env:// needs an address, and a world of one meets only itself, on
        # this host: a MASTER_ADDR left in the environment that does not resolve kept torch's store
        # retrying forever, deaf to SIGTERM
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        return False
    join_timeout_s = join_timeout_s or 600.0
    deadline = time.monotonic() + join_timeout_s
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    _resolve(host, port, deadline)
    if agent_store:
        # torchrun keeps one store for every restart attempt and env:// does not namespace its keys:
        # a new attempt's gloo ranks read a dead attempt's addresses and hang in connectFullMesh (torch
        # 2.13), so each attempt joins under its own prefix
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=join_timeout_s))
        prefix = f"megaframe/attempt{attempt}/"
    else:
        store = _connect(host, port, rank, world, join_timeout_s, deadline)
        prefix = "megaframe/"
    # by world size too: torchrun keeps the restart count (and so the prefix) when a node joins or leaves.
    # A count left from an earlier round of the same size only lets the wait pass early, never hangs it.
    wait_for_world(store, f"{prefix}join/world{world}/", rank, world, join_timeout_s, deadline)
    if timeout is not None:
        store.set_timeout(timeout)  # the group's own waits: the collective timeout from here on
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timeout, device_id=bound_device(backend))
    return True


def bound_device(backend: str) -> Optional[torch.device]:
    """init_process_group's device_id under NCCL: this rank's device, set before it joins. Bound, the
    default group's communicator is made at the join (every rank has arrived by then), each later
    group's (tp, dp, pp, ...) is split from it (ncclCommSplit) instead of being made from scratch,
    and barrier() runs on it instead of a device guessed from the rank number. None for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
