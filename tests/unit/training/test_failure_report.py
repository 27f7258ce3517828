"""A failed run's translation (training/failure_report.py): a collective that timed out is reported
as a hung rank at the step it happened, anything else as itself."""
from __future__ import annotations

import errno

from megaframe.common.failures import RankHung
from megaframe.training.failure_report import report_failure, translate


def test_a_collective_timeout_becomes_a_hung_rank_at_its_step():
    timeout = RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    hung = translate(timeout, 7, 0.01)
    assert isinstance(hung, RankHung) and hung.__cause__ is timeout
    assert "at step 7" in str(hung) and "train.collective_timeout_s=0.01" in str(hung)
    assert "before the first step" in str(translate(timeout, 0, 0.01))
    other = ValueError("bad value")
    assert translate(other, 7, 0.01) is other


def test_a_run_dir_gone_mid_run_is_said_with_exit_8_and_nothing_made_there(tmp_path, capsys):
    """A run dir moved or deleted under a running job: the failure that follows (metrics.jsonl not
    found) was a bare FileNotFoundError, exit 1, and the traceback's logs/ folder was made again at
    the old path, which a resume then took for the run (review)."""
    gone = tmp_path / "r24"
    error = FileNotFoundError(errno.ENOENT, "No such file or directory", str(gone / "metrics.jsonl"))
    assert report_failure(error, gone, rank=0) == 8
    assert capsys.readouterr().err == (
        f"megaframe-train: error (rank 0): run dir {gone} is gone (moved or deleted while the run trained), so its "
        f"files could not be written; if it was moved, continue there: megaframe-train train.resume=auto "
        f"hydra.run.dir=NEW_PATH [exit 8]\n")
    assert not gone.exists()
    gone.mkdir()  # there: the error is the error's own, with its traceback logged
    assert report_failure(error, gone, rank=0) == 1
    assert "FileNotFoundError" in capsys.readouterr().err and (gone / "logs" / "rank0.log").is_file()
