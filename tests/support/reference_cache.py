"""Single-rank reference runs computed once per pytest session, shared by every module and xdist worker.

The parity files compare a layout's curve with the same run at one rank; several files need the same
reference (the tiny gpt2 and llama runs of 12 steps: tests/dist/test_zero.py, test_tensor_parallel.py,
test_context_parallel_training.py), and each used to train it again. reference_runs() trains the
ones this session has not trained yet, in one forked rank as before, into a cache folder, and returns
the cached run folders (read them, do not write into them).

Where: the folder tests/conftest.py names in SESSION_ENV for the session: `reference-runs` under the
session's basetemp, so a fresh CI run with empty caches computes each reference once, and nothing is
kept from one session to the next. MEGAFRAME_TESTS_REFERENCE_CACHE=DIR keeps them in DIR instead
(a local inner loop); the key then still tells a stale entry from a good one (below).

Key: the composed config (so two override lists that compose the same run share it, and any override
that changes the run misses), the variant (engine, float64, the function that trains), torch's
version, ATEN_CPU_CAPABILITY and OMP_NUM_THREADS as this process has them, and a digest of megaframe's
sources and conf/ (a persistent cache never serves a run of other code).

Concurrency: one lock file per key (filelock, which torch itself requires), taken in key order, so two
workers wanting the same reference compute it once and never deadlock; a run is trained into a
private folder and renamed into place, so a reader never sees half a run, and a failed run leaves
nothing behind. Runs that measure the host's rounding (parity.OTHER_ORDER's fresh interpreter, the
numerics tests) are not cached.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

SESSION_ENV = "MEGAFRAME_TESTS_SESSION_REFERENCES"  # set by tests/conftest.py for the session
KEEP_ENV = "MEGAFRAME_TESTS_REFERENCE_CACHE"  # a user's persistent folder instead
_REPO = Path(__file__).resolve().parents[2]
_FORMAT = 1  # bump when what an entry holds changes


def cache_dir() -> Optional[Path]:
    """This session's cache folder, or None outside a pytest session of this suite (compute live)."""
    where = os.environ.get(SESSION_ENV)
    return Path(where) if where else None


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    digest = hashlib.sha256()
    # the harness that trains the runs (tests/support: train_runs, run_ranks, the warm ranks) too
    for folder, pattern in (("megaframe", "*.py"), ("conf", "*.yaml"), ("tests/support", "*.py")):
        for path in sorted((_REPO / folder).rglob(pattern)):
            digest.update(str(path.relative_to(_REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _library_versions() -> dict[str, str]:
    """The engines' and converters' versions a reference run went through (a kept cache across an
    upgrade must miss)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("deepspeed", "transformers", "numpy"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = ""
    return found


def key_of(overrides: list[str], variant: dict[str, Any], environ: Optional[dict[str, str]] = None) -> str:
    """The cache key of one run: its composed config, the variant, torch's version, the CPU capability,
    the thread count, megaframe's sources and the test harness's, and DeepSpeed's and transformers'
    versions."""
    import torch

    from megaframe.config.compose import compose

    environ = os.environ if environ is None else environ
    cfg, _ = compose(list(overrides))
    payload = {
        "format": _FORMAT, "config": dataclasses.asdict(cfg), "variant": variant, "torch": torch.__version__,
        "capability": environ.get("ATEN_CPU_CAPABILITY", ""), "threads": environ.get("OMP_NUM_THREADS", ""),
        "source": _source_digest(), "libraries": _library_versions(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached(keys: dict[str, str], produce: Callable[[dict[str, Path]], None], fallback: Path) -> dict[str, Path]:
    """The folder of each named run (name -> key). produce({name: folder}) trains the missing ones, one
    folder per distinct key, in one call. Outside a session (no cache folder) every run is produced
    live under `fallback`."""
    root = cache_dir()
    if root is None:
        folders = {name: fallback / name for name in keys}
        produce(folders)
        return folders
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with ExitStack() as locks:
        for key in sorted(set(keys.values())):
            locks.enter_context(FileLock(str(root / f"{key}.lock")))
        missing = {}
        for name, key in keys.items():
            if not (root / key).is_dir() and key not in missing.values():
                missing[name] = key
        _log(root, keys, missing)
        if missing:
            work = root / f"partial-{os.getpid()}-{time.monotonic_ns()}"
            work.mkdir()
            try:
                produce({name: work / name for name in missing})
                for name, key in missing.items():
                    os.rename(work / name, root / key)  # atomic: a run is there whole or not at all
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return {name: root / key for name, key in keys.items()}


def _log(root: Path, keys: dict[str, str], missing: dict[str, str]) -> None:
    """One line per lookup in ROOT/lookups.jsonl: what hit and what was trained (the report's counts)."""
    with open(root / "lookups.jsonl", "a") as f:  # one short line per write
        for name, key in keys.items():
            f.write(json.dumps({"name": name, "key": key, "hit": key not in missing.values(),
                                "pid": os.getpid()}) + "\n")


def reference_runs(runs: dict[str, list[str]], fallback: Path, *, train: Optional[Callable] = None,
                   **train_kwargs: Any) -> dict[str, Path]:
    """Each named single-rank run (name -> overrides), trained by `train` (parity.train_runs unless
    given) in one forked rank when this session has not trained it yet. train_kwargs (engine, fp64)
    are part of the key. Returns the run folders by name."""
    from tests.support.parity import train_runs
    from tests.support.ranks import run_ranks

    train = train or train_runs
    variant = {"train": f"{train.__module__}.{train.__qualname__}", **train_kwargs}
    keys = {name: key_of(overrides, variant) for name, overrides in runs.items()}

    def produce(folders: dict[str, Path]) -> None:
        work = next(iter(folders.values())).parent
        run_ranks(train, 1, work, runs=[(runs[name], str(folder)) for name, folder in folders.items()], **train_kwargs)

    return cached(keys, produce, fallback)
