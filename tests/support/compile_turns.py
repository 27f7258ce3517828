"""The ranks of one run_ranks call take turns at inductor's graph compiles (tests/support/ranks.py).

Why: with train.compile=true every rank compiles the same graphs (TP, CP, EP and DP ranks hold the
same shapes) at the same moment, so on a fresh CI host with an empty inductor cache each of them
misses the cache and lowers, generates and builds (gcc) every kernel itself: N times the work.
Taking turns, the first rank to reach a graph compiles it and saves it in inductor's FX graph
cache, and the others load it from there: the same generated code, so the same numbers.

How: torch._inductor.compile_fx._compile_fx_inner (one graph, forward or backward: cache lookup,
compile, cache save; torch's own tests patch it the same way) runs under a file lock shared by the
ranks. Nothing inside it talks to the other ranks (inductor's compile-time collectives are opt-in;
with one switched on, compiles do not take turns), so a rank waits for the lock only while another
compiles, never while holding it for a collective. Installed when inductor's module is imported
(or at once if this process already has it): runs that do not compile never import inductor for it.

Two more costs of a rank's compiles that change nothing it computes (lighter_compiles):
- dynamo times every new guard set once to log its latency (torch._dynamo.guards: profile_guard_manager,
  which first flushes the CPU caches). The guards themselves are built and checked as before; only
  the logged `guard_latency_us` metric reads 0.
- inductor compiles kernels in a pool of worker processes (compile_threads = the core count), each
  a new interpreter importing torch, in every rank; on CI's two shared cores the pool buys no
  parallelism, and a forked rank exits without reaping it. With one thread the same kernels are
  generated and built in the rank itself.
Together about 3% of a cold compiled test (tests/dist/test_tensor_parallel.py's compiled blocks: 100.4
CPU-s of the whole process tree before, 97.3 after). Most of what remains is g++ building each kernel
(that test builds 57; about 2.8 CPU-s one, 1.9 of them for cpp_prefix.h alone, by hand on this host).
"""
from __future__ import annotations

import functools
import os
import sys

_MODULE = "torch._inductor.compile_fx"


def take_turns_at_compiles(lock_path: str) -> None:
    """Every inductor graph compile of this process from now on holds the file lock at lock_path
    (and is lighter: lighter_compiles)."""
    lighter_compiles()
    if _MODULE in sys.modules:
        _wrap(sys.modules[_MODULE], lock_path)
        return

    from tests.support.warm_ranks import _after_import

    _after_import(_MODULE, lambda: _wrap(sys.modules[_MODULE], lock_path))


_GUARDS = "torch._dynamo.guards"


def lighter_compiles() -> None:
    """This process's dynamo logs no guard latency, and inductor compiles its kernels in-process
    (the module docstring says why; neither changes a graph, a guard or a generated kernel)."""
    # read when inductor first compiles (async_compile.get_compile_threads), unless its config set it
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = 1
    if _GUARDS in sys.modules:
        _no_guard_latency(sys.modules[_GUARDS])
        return

    from tests.support.warm_ranks import _after_import

    _after_import(_GUARDS, lambda: _no_guard_latency(sys.modules[_GUARDS]))


def _no_guard_latency(guards) -> None:
    """guards.profile_guard_manager(root, scope, n_iters) -> latency in us: only logged."""
    guards.profile_guard_manager = _unmeasured


def _unmeasured(*args, **kwargs) -> float:
    return 0.0


def _wrap(module, lock_path: str) -> None:
    compile_one = module._compile_fx_inner
    if getattr(compile_one, "_turns_at", None) == lock_path:
        return
    compile_one = getattr(compile_one, "__wrapped_by_turns__", compile_one)
    from filelock import FileLock

    # not thread-local: a backward graph may compile on autograd's thread while the lock is this process's
    lock = FileLock(lock_path, thread_local=False)

    @functools.wraps(compile_one)
    def in_turn(*args, **kwargs):
        if _compile_talks_to_ranks():
            return compile_one(*args, **kwargs)
        with lock:
            return compile_one(*args, **kwargs)

    in_turn._turns_at = lock_path
    in_turn.__wrapped_by_turns__ = compile_one
    module._compile_fx_inner = in_turn


def _compile_talks_to_ranks() -> bool:
    """inductor's opt-in compile-time collectives (runtime estimates aligned across ranks, distributed
    GEMM autotuning): a rank holding the lock there would wait for ranks that wait for the lock."""
    from torch._inductor import config, config_comms

    return bool(getattr(config, "distributed_max_autotune_gemm", False)
                or getattr(config_comms, "runtime_estimations_align_across_all_distributed_ranks", False))
