"""The session's reference-run cache (tests/support/reference_cache.py): keyed by what makes a run,
each key trained once across processes, a run published whole or not at all."""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from tests.support import reference_cache
from tests.support.helpers import TINY
from tests.support.reference_cache import SESSION_ENV, cached, key_of

RUN = [*TINY, "train.max_steps=12", "train.eval_interval=6"]
ENV = {"ATEN_CPU_CAPABILITY": "", "OMP_NUM_THREADS": "1"}


def test_the_key_changes_with_the_run_torch_the_capability_and_the_threads(monkeypatch):
    base = key_of(RUN, {}, ENV)
    # the composed config is the key: the same run spelled otherwise (gpt_tiny is the default model) hits
    assert key_of(["model=gpt_tiny", *RUN], {}, ENV) == key_of([*RUN, "model=gpt_tiny"], {}, ENV) == base
    misses = {
        "another override": key_of([*RUN, "optim.lr=0.002"], {}, ENV),
        "another model": key_of([*RUN, "model=llama_tiny"], {}, ENV),
        "another engine": key_of(RUN, {"engine": "deepspeed"}, ENV),
        "another capability": key_of(RUN, {}, {**ENV, "ATEN_CPU_CAPABILITY": "default"}),
        "another thread count": key_of(RUN, {}, {**ENV, "OMP_NUM_THREADS": "2"}),
    }
    monkeypatch.setattr("torch.__version__", "9.9.9")
    misses["another torch"] = key_of(RUN, {}, ENV)
    monkeypatch.undo()
    monkeypatch.setattr(reference_cache, "_source_digest", lambda: "other sources")
    misses["other megaframe sources"] = key_of(RUN, {}, ENV)
    assert all(key != base for key in misses.values()), {what: key == base for what, key in misses.items()}
    assert len(set(misses.values())) == len(misses)


def _produce_into(log: Path, fail: bool = False):
    def produce(folders: dict[str, Path]) -> None:
        with open(log, "a") as f:
            f.write(" ".join(sorted(folders)) + "\n")
        for name, folder in folders.items():
            folder.mkdir(parents=True)
            (folder / "metrics.jsonl").write_text(name)
            time.sleep(0.3)  # long enough for a second process to ask meanwhile
        if fail:
            raise RuntimeError("the run failed")
    return produce


def test_each_key_is_trained_once_and_a_failed_run_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(SESSION_ENV, str(tmp_path / "cache"))
    log = tmp_path / "trained"
    with pytest.raises(RuntimeError, match="the run failed"):
        cached({"a": "k1"}, _produce_into(log, fail=True), tmp_path)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k1.lock", "lookups.jsonl"]  # no half run

    first = cached({"a": "k1", "b": "k1", "c": "k2"}, _produce_into(log), tmp_path)
    assert first == {"a": tmp_path / "cache" / "k1", "b": tmp_path / "cache" / "k1", "c": tmp_path / "cache" / "k2"}
    assert (first["c"] / "metrics.jsonl").read_text() == "c"
    again = cached({"b": "k1", "d": "k3"}, _produce_into(log), tmp_path)  # k1 hits, k3 is new
    assert again["b"] == first["b"]
    assert log.read_text().splitlines() == ["a", "a c", "d"]


def _ask(cache: str, log: str) -> None:
    import os

    os.environ[SESSION_ENV] = cache
    cached({"run": "shared"}, _produce_into(Path(log)), Path(log).parent)


def test_processes_asking_at_once_train_it_once(tmp_path):
    context = multiprocessing.get_context("fork")
    asking = [context.Process(target=_ask, args=(str(tmp_path / "cache"), str(tmp_path / "trained"))) for _ in range(3)]
    for process in asking:
        process.start()
    for process in asking:
        process.join(60)
    assert [process.exitcode for process in asking] == [0, 0, 0]
    assert (tmp_path / "trained").read_text().splitlines() == ["run"]
