"""Exit codes and the classification of errors raised after launch (megaframe/common/failures.py)."""
from __future__ import annotations

from megaframe.checkpoint.universal import CheckpointError
from megaframe.data import DataError
from megaframe.common.failures import (BadCheckpoint, BadData, ExitCode, RunFailure, classify, exit_code_of_job,
                                is_peer_failure)


def test_errors_of_other_modules_map_to_their_exit_codes():
    assert isinstance(classify(DataError("data.path=x: bad")), BadData)
    assert classify(DataError("data.path=x: bad")).exit_code == ExitCode.BAD_DATA == 4
    assert classify(CheckpointError("corrupt")).exit_code == ExitCode.BAD_CHECKPOINT == 5
    assert isinstance(classify(CheckpointError("corrupt")), BadCheckpoint)
    internal = classify(ZeroDivisionError("division by zero\nmore"))
    assert type(internal) is RunFailure and internal.exit_code == 1 and str(internal) == "ZeroDivisionError: division by zero"


def test_the_job_exit_code_is_the_cause_not_the_ranks_that_followed_it():
    assert exit_code_of_job([1, 3]) == 3  # rank 0 saw its peer close the connection
    assert exit_code_of_job([-15, 7]) == 7  # the hung rank was killed by the agent
    assert exit_code_of_job([1, -9]) == 1
    assert exit_code_of_job([0, 0]) == 0
    assert exit_code_of_job([143, 143]) == 143  # SIGTERM: every rank stopped at one step boundary
    assert exit_code_of_job([130, -15]) == 130  # rank 1 was still closing when the agent ended it
    assert exit_code_of_job([-15, -15]) == 1  # killed, not stopped: no rank said it stopped
    assert exit_code_of_job([143, 1]) == 1
    assert exit_code_of_job([131, -3]) == 131  # SIGQUIT: every rank quit at once, as asked (not INTERNAL)
    # ranks refused to start (under torchrun each composes and checks for itself: a run dir in use)
    assert exit_code_of_job([2, 2]) == 2
    assert exit_code_of_job([2, -15]) == 2  # the agent ended the other rank once the first exited
    assert exit_code_of_job([2, 5]) == 5


def test_peer_failures_are_consequences():
    assert is_peer_failure(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"))
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))


def test_the_guides_exit_code_table_lists_every_code():
    """docs/failures.md's table is where users look a code up: every ExitCode, and no other number."""
    import re

    from tests.support.helpers import REPO

    guide = (REPO / "docs" / "failures.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = {int(m) for m in re.findall(r"^\| (\d+) \|", guide, flags=re.M)}
    assert listed == {0, *(int(code) for code in ExitCode)}


def test_a_full_disk_wherever_the_run_writes_is_exit_8_not_an_internal_error():
    """metrics.jsonl, W&B's offline folder, a fast-tier part (torch.save's zip writer says it as a
    RuntimeError, no errno) and a fast-tier checkpoint copied back to the run dir were exit 1, "an
    internal error (a bug)", with a bare OSError line (review)."""
    import errno

    for err in (OSError(errno.ENOSPC, "No space left on device"),
                OSError(errno.EDQUOT, "Disk quota exceeded", "/runs/r/metrics.jsonl"),
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726")):
        failure = classify(err)
        assert failure.exit_code == ExitCode.SAVE_FAILED == 8 and "\n" not in str(failure), failure
        assert "free space or raise the quota where it writes, then resume: train.resume=auto" in str(failure)
    assert "(/runs/r/metrics.jsonl)" in str(classify(OSError(errno.EDQUOT, "Disk quota exceeded",
                                                             "/runs/r/metrics.jsonl")))
    for other in (OSError(errno.ENOENT, "No such file or directory", "x"), RuntimeError("shape mismatch")):
        assert classify(other).exit_code == ExitCode.INTERNAL  # not every OSError is the disk's
