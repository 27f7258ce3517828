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
"""
from __future__ import annotations

import functools
import sys

_MODULE = "torch._inductor.compile_fx"


def take_turns_at_compiles(lock_path: str) -> None:
    """Every inductor graph compile of this process from now on holds the file lock at lock_path."""
    if _MODULE in sys.modules:
        _wrap(sys.modules[_MODULE], lock_path)
        return

    from tests.support.warm_ranks import _after_import

    _after_import(_MODULE, lambda: _wrap(sys.modules[_MODULE], lock_path))


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
