"""launcher=ray on a local Ray cluster of 2 CPU workers: the dp=2 self-launch curve, and a worker
killed mid-run is restarted by Ray (FailureConfig), the run resumes from its checkpoint and ends
with the uninterrupted run's metrics; without Ray installed, one line before anything starts."""
from __future__ import annotations

import os

import pytest

from helpers import TINY, assert_ok, cli_env, read_metrics, run_cli
from parity import assert_parity

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=6", "train.eval_interval=3", "train.save_interval=2", "zero=stage1", "parallel.dp=2"]


def test_ray_workers_train_the_dp2_curve_and_survive_a_killed_worker(tmp_path):
    pytest.importorskip("ray", reason="Ray is the optional extra megaframe[ray]; .ci/run installs it with [test]")
    reference, ray_run = tmp_path / "reference", tmp_path / "ray"
    assert_ok(run_cli([*ARGS, f"hydra.run.dir={reference}"]))
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    env = {**cli_env(), "OMP_NUM_THREADS": "1", "MEGAFRAME_FAULTS": "kill@4:1", "MEGAFRAME_FAULTS_STAMPS": str(stamps)}
    result = run_cli([*ARGS, "launcher=ray", "launcher.max_failures=1", f"hydra.run.dir={ray_run}"], env=env)
    assert_ok(result)
    assert (stamps / "kill-rank1-step4").exists(), "the fault did not fire: nothing was restarted"
    out = result.stdout + result.stderr
    assert "resumed from" in out and "at step 2" in out
    assert_parity(read_metrics(ray_run), read_metrics(reference), "launcher=ray with a restart against dp=2")


def test_without_ray_launcher_ray_is_one_line_before_anything_starts(tmp_path):
    blocker = tmp_path / "no_ray"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(  # hides an installed ray from the check
        "import importlib.util, sys\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a, **k: None if name == 'ray' else _find(name, *a, **k)\n")
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join([str(blocker), cli_env().get("PYTHONPATH", "")])}
    result = run_cli([*ARGS, "launcher=ray", f"hydra.run.dir={tmp_path / 'run'}"], env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "megaframe[ray]"' in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
