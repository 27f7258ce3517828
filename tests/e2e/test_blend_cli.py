"""data.blend through megaframe-train: the same samples at dp=1, dp=2 and across a resume, and the
tokens each source gave in metrics.jsonl."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.helpers import TINY, assert_ok, cli_env, read_metrics, run_cli

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=6", "train.eval_interval=3", "model.dropout=0.0"]


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two byte datasets that a model tells apart: low bytes and high bytes."""
    from megaframe.data import IndexedDatasetWriter

    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    for name, low in (("low", 0), ("high", 128)):
        with IndexedDatasetWriter(root / name) as writer:
            for _ in range(60):
                writer.add_document([*rng.integers(low, low + 128, int(rng.integers(40, 120))), 256])
            writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    return f"data.blend=[0.3,{root / 'low'},0.7,{root / 'high'}]"


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def test_a_blend_trains_the_same_samples_at_dp1_dp2_and_across_a_resume(two_sources, tmp_path):
    whole, dp2, parts = tmp_path / "whole", tmp_path / "dp2", tmp_path / "parts"
    assert_ok(run_cli([*ARGS, two_sources, "train.save_interval=3", f"hydra.run.dir={whole}"]))
    records = [r for r in read_metrics(whole) if "loss" in r]
    for r in records:  # every token came from one of the sources, in about the blend's shares
        low, high = r["consumed_tokens/low"], r["consumed_tokens/high"]
        assert low + high == r["consumed_tokens"]
    assert abs(records[-1]["consumed_tokens/low"] / records[-1]["consumed_tokens"] - 0.3) < 0.05

    assert_ok(run_cli([*ARGS, two_sources, "parallel.dp=2", f"hydra.run.dir={dp2}"]))
    reference = losses(whole)
    assert [s for s, _ in losses(dp2)] == [s for s, _ in reference]
    np.testing.assert_allclose([l for _, l in losses(dp2)], [l for _, l in reference], rtol=1e-4)

    assert_ok(run_cli([*ARGS, two_sources, "train.save_interval=3", "train.exit_at_step=3", f"hydra.run.dir={parts}"]))
    result = run_cli([*ARGS, two_sources, "train.save_interval=3", f"hydra.run.dir={parts}"])
    assert_ok(result)
    assert "at step 3" in result.stdout
    assert losses(parts) == reference  # exactly: same samples, same arithmetic


@pytest.mark.parametrize("extra, message", [
    (["data.blend=[0.3,/nowhere/a,0.7,/nowhere/b]"], "data.blend: /nowhere/a.bin not found"),
    (["data.blend=[0.3,/nowhere/a,0.7]"], "in pairs"),
    (["data.blend_schedule=[[5,[0.5,0.5]]]"], "data.blend_schedule needs data.blend"),
])
def test_a_malformed_blend_is_one_line_before_launch(extra, message, tmp_path):
    result = run_cli([*ARGS, *extra, f"hydra.run.dir={tmp_path}"], env=cli_env())
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]


def test_a_schedule_entry_of_the_wrong_length_names_the_form(two_sources, tmp_path):
    result = run_cli([*ARGS, two_sources, "data.blend_schedule=[[4,[1.0]]]", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 2
    assert "must be [STEP, [2 weights]]" in result.stderr and len(result.stderr.strip().splitlines()) == 1
