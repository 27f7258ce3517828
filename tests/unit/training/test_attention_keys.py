"""The attention keys reach the model through the trainer (issue 54): a window as long as the
sequence trains the curve of no window bitwise, and data.document_mask (with eod_mask_loss) on the
demo corpus, whose documents end in end-of-document tokens, trains another curve. One forked rank,
both runs in it; the reference is the single-rank run other files share (reference cache)."""
from __future__ import annotations

import math

from tests.support.helpers import TINY, curve, read_metrics
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

STEPS = ["train.max_steps=12", "train.eval_interval=6"]  # the reference of tests/dist/test_zero.py


def test_trainer_applies_the_window_and_document_keys(tmp_path):
    reference = read_metrics(reference_runs({"ref": [*TINY, *STEPS]}, tmp_path / "single")["ref"])
    window, documents = tmp_path / "window", tmp_path / "documents"
    run_ranks(train_runs, 1, tmp_path, runs=[
        ([*TINY, *STEPS, "model.sliding_window=32"], str(window)),  # TINY's model.seq_length
        ([*TINY, *STEPS, "data.document_mask=true", "data.eod_mask_loss=true"], str(documents))])
    for key in ("loss", "eval_loss", "grad_norm"):
        assert curve(read_metrics(window), key) == curve(reference, key) != [], key
    masked, plain = curve(read_metrics(documents), "loss"), curve(reference, "loss")
    assert len(masked) == len(plain) == 12 and all(math.isfinite(v) for _, v in masked)
    assert masked != plain
