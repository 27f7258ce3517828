"""A failed run's translation (training/failure_report.py): a collective that timed out is reported
as a hung rank at the step it happened, anything else as itself."""
from __future__ import annotations

from megaframe.common.failures import RankHung
from megaframe.training.failure_report import translate


def test_a_collective_timeout_becomes_a_hung_rank_at_its_step():
    timeout = RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    hung = translate(timeout, 7, 0.01)
    assert isinstance(hung, RankHung) and hung.__cause__ is timeout
    assert "at step 7" in str(hung) and "train.collective_timeout_s=0.01" in str(hung)
    assert "before the first step" in str(translate(timeout, 0, 0.01))
    other = ValueError("bad value")
    assert translate(other, 7, 0.01) is other
