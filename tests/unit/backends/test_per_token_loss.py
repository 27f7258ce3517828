"""data.eod_mask_loss: a step's loss is the loss per counted target of the whole global batch, as
Megatron-LM's --calculate-per-token-loss makes it, whatever parallel.micro_batch_size cuts the batch
into. The targets after an end of document are left out, so micro-batches hold unequal counts; the
mean of their own means weighed a target in a short micro-batch more, and the curve depended on the
micro-batch size (docs/attention.md measured 5.524238 against 5.524297 at step 2).

The oracle is the run at micro-batch 8 = the global batch: one micro-batch whose plain mean is the
per-target mean (its weight is exactly 1.0), which the runs at micro-batches 2 and 1 must follow.
Short documents (tests/support/short_documents.py): every sample holds several. One forked rank."""
from __future__ import annotations

import pytest

from tests.support.helpers import TINY, curve, read_metrics
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks
from tests.support.short_documents import write_short_documents

STEPS = ["train.max_steps=4", "train.eval_interval=2", "train.eval_steps=2"]


@pytest.mark.parametrize("micro", [1, 2])
def test_the_loss_per_counted_target_does_not_depend_on_the_micro_batch_size(tmp_path, micro):
    corpus = write_short_documents(tmp_path / "short")
    base = [*TINY, *STEPS, "data.eod_mask_loss=true", f"data.path={corpus}", "parallel.global_batch_size=8"]
    whole, cut = tmp_path / "micro8", tmp_path / f"micro{micro}"
    run_ranks(train_runs, 1, tmp_path, runs=[([*base, "parallel.micro_batch_size=8"], str(whole)),
                                             ([*base, f"parallel.micro_batch_size={micro}"], str(cut))])
    for key in ("loss", "eval_loss"):
        expected, got = curve(read_metrics(whole), key), curve(read_metrics(cut), key)
        assert len(expected) == len(got) > 0, key
        for (step, want), (_, value) in zip(expected, got):
            # fp32 sums in another order, nothing more (the micro-batches' own means differed by 1e-5)
            assert value == pytest.approx(want, rel=2e-6), (key, step, value, want)
