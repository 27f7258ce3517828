"""The ranks of one run_ranks call take turns at inductor's graph compiles (tests/support/compile_turns.py):
no two processes inside the wrapped compile at once, installed on import when inductor is not loaded yet."""
from __future__ import annotations

import json
import multiprocessing
import sys
import time
import types

from tests.support import compile_turns


def _compile_like_a_rank(module_name: str, lock: str, log: str, start: float) -> None:
    """In a forked process: wait for the common start, then one `compile` recording when it ran."""
    module = sys.modules[module_name]
    compile_turns._wrap(module, lock)
    while time.time() < start:
        time.sleep(0.005)
    module._compile_fx_inner(log)


def _stand_in_compile(log: str) -> str:
    began = time.time()
    time.sleep(0.3)
    with open(log, "a") as f:
        f.write(json.dumps([began, time.time()]) + "\n")
    return "compiled"


def _intervals(module_name: str, tmp_path, wrapped: bool) -> list[list[float]]:
    log = tmp_path / f"log-{wrapped}"
    context = multiprocessing.get_context("fork")
    start = time.time() + 0.5
    target = _compile_like_a_rank if wrapped else (lambda name, lock, log, start: (
        time.sleep(max(0.0, start - time.time())), sys.modules[name]._compile_fx_inner(log)))
    ranks = [context.Process(target=target, args=(module_name, str(tmp_path / "inductor.lock"), str(log), start))
             for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(30)
    assert [rank.exitcode for rank in ranks] == [0, 0, 0]
    return sorted(json.loads(line) for line in log.read_text().splitlines())


def test_ranks_compile_one_graph_at_a_time_and_the_result_is_the_compiles(tmp_path, monkeypatch):
    module = types.ModuleType("stand_in_compile_fx")
    module._compile_fx_inner = _stand_in_compile
    monkeypatch.setitem(sys.modules, module.__name__, module)
    # the control: unwrapped, the three compile at the same moment (the test would see a broken lock)
    together = _intervals(module.__name__, tmp_path, wrapped=False)
    assert any(later[0] < earlier[1] for earlier, later in zip(together, together[1:])), together
    in_turn = _intervals(module.__name__, tmp_path, wrapped=True)
    assert len(in_turn) == 3 and all(later[0] >= earlier[1] for earlier, later in zip(in_turn, in_turn[1:])), in_turn
    compile_turns._wrap(module, str(tmp_path / "inductor.lock"))
    compile_turns._wrap(module, str(tmp_path / "inductor.lock"))  # idempotent: one lock, not two nested
    assert module._compile_fx_inner.__wrapped_by_turns__ is _stand_in_compile
    assert module._compile_fx_inner(str(tmp_path / "one")) == "compiled"


def test_installed_when_inductor_is_imported_later(tmp_path, monkeypatch):
    (tmp_path / "late_compile_fx.py").write_text("def _compile_fx_inner(*args):\n    return 'compiled'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(compile_turns, "_MODULE", "late_compile_fx")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "late_compile_fx", raising=False)
    compile_turns.take_turns_at_compiles(str(tmp_path / "inductor.lock"))
    import late_compile_fx

    assert late_compile_fx._compile_fx_inner._turns_at == str(tmp_path / "inductor.lock")
    assert late_compile_fx._compile_fx_inner() == "compiled"
    assert not any(type(finder).__name__ == "AfterImport" for finder in sys.meta_path)  # it went once used


def _compile_lighter(out: str) -> None:
    """In a forked process: lighter_compiles, then one dynamo compile; record what it measured."""
    import torch

    calls = []
    compile_turns._unmeasured = lambda *args, **kwargs: calls.append(args) or 0.0
    compile_turns.lighter_compiles()
    import torch._inductor.config as inductor_config

    got = torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    with open(out, "w") as f:
        json.dump({"values": got.tolist(), "timed": len(calls), "threads": inductor_config.compile_threads}, f)


def test_lighter_compiles_time_no_guards_and_use_no_compile_pool(tmp_path):
    """dynamo's guard latency profile (a CPU cache flush per compiled frame) goes through the stand-in
    that times nothing, and inductor compiles in the rank itself; the compiled function computes as before."""
    out = tmp_path / "lighter.json"
    process = multiprocessing.get_context("fork").Process(target=_compile_lighter, args=(str(out),))
    process.start()
    process.join(120)
    assert process.exitcode == 0
    found = json.loads(out.read_text())
    # timed > 0: the guards' latency went through the stand-in (a torch that renamed it would show here)
    assert found == {"values": [3.0, 3.0, 3.0], "timed": 1, "threads": 1}, found
