"""megaframe-train runs on the device, for tests/fakecuda_tier: each checked for violations in every
process, a report per rank, and the emulated kernels it was expected to use."""
from __future__ import annotations

import re
import time
from pathlib import Path

from tests.support.fakecuda.env import fake_cuda_env
from tests.support.helpers import TINY, assert_ok, curve, read_metrics, run_cli

STEPS = ["train.max_steps=6", "train.eval_interval=3"]
CPU_PADDING = "model.make_vocab_size_divisible_by=128"  # the device's padding, on the CPU too


def run_on_device(tmp_path, name: str, extra: list[str], world: int = 1, kernels: tuple[str, ...] = (),
                  **env: str) -> list[dict]:
    """Train under the tier; return the run's metrics after checking every process's report (and that
    each rank ran the emulated CUDA kernels named in `kernels`)."""
    from tests.support.fakecuda.ledger import read_reports

    run_dir, reports = tmp_path / name, tmp_path / f"{name}-reports-{time.monotonic_ns()}"  # one per run
    result = run_cli([*TINY, *STEPS, *extra, f"hydra.run.dir={run_dir}"], env=fake_cuda_env(reports, **env))
    assert_ok(result)
    assert "| device cuda:0 (NVIDIA H100" in result.stdout, result.stdout[-2000:]
    padded = re.search(r"vocab=257 padded to (\d+)", result.stdout)  # a GPU's padding: whole tensor-core tiles
    assert padded and int(padded[1]) % 128 == 0, result.stdout[-2000:]
    ranks = [r for r in read_reports(reports) if "megaframe" in " ".join(r["argv"])]
    trained = [r for r in ranks if r["rank"] is not None]
    assert len(trained) == world, f"{name}: {len(trained)} rank reports for {world} ranks: {ranks}"
    for report in ranks:
        assert report["violations"] == [], f"{name}: rank {report['rank']}: {report['violations']}"
    assert all(any(kind == "item" for kind, _, _ in r["syncs"]) for r in trained), "no host read counted at all"
    for r in trained:
        assert all(r["kernels"].get(f"aten.{k}.default") for k in kernels), (kernels, r["kernels"])
    return read_metrics(run_dir)


def cpu_run(tmp_path, extra: list[str] = ()) -> list[dict]:
    """The same schedule on plain CPU ranks: the reference curve, of the same model: padded as the
    device pads the vocabulary (a CPU would not pad it at all)."""
    run_dir = tmp_path / "cpu-run"
    assert_ok(run_cli([*TINY, *STEPS, *extra, CPU_PADDING, f"hydra.run.dir={run_dir}"]))
    return read_metrics(run_dir)


def cpu_run_dir(fallback: Path) -> Path:
    """The folder of cpu_run() with no extra overrides (its metrics and final checkpoint: read, never
    write), trained once per test session for every file of the tier (tests/support/reference_cache.py)."""
    from tests.support.reference_cache import cached, key_of

    key = key_of([*TINY, *STEPS, CPU_PADDING], {"run": "megaframe-train"})
    return cached({"cpu-run": key}, lambda folders: cpu_run(folders["cpu-run"].parent), fallback)["cpu-run"]


def assert_curves_within(got: list[dict], want: list[dict], rel: float, what: str) -> None:
    """Every logged loss and eval loss of `got` at the steps of `want`'s (two at least), within rel."""
    import pytest

    for key in ("loss", "eval_loss"):
        g, w = curve(got, key), curve(want, key)
        assert [s for s, _ in g] == [s for s, _ in w] and len(w) >= 2, f"{what}: {key} steps differ"
        for (step, a), (_, b) in zip(g, w):
            assert a == pytest.approx(b, rel=rel), f"{what}: {key} at step {step}: {a} vs the CPU's {b}"
