"""What a rank does when its run fails after launch: the traceback to RUN_DIR/logs/rankR.log, one
line on stderr (from one rank, not from every rank that saw it), the exit code of the cause, and,
for a failure a restart would repeat, a note that stops torchrun from replaying it."""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from megaframe.common.failures import (PROG, ExitCode, JobStopped, RankHung, RunFailure, SaveFailed, classify,
                                       is_peer_failure)
from megaframe.parallel.elastic import record_job_stop
from megaframe.parallel.hang import describe_hang, is_collective_timeout
from megaframe.common.safe_files import open_regular
_REPORTED = "megaframe/failure_reported"


def log_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` writes the tracebacks of its failures."""
    return Path(run_dir) / "logs" / f"rank{rank}.log"


def append_to_log(path: Path, text: str) -> None:
    """Append a dated entry to a rank's log (appended: every attempt's entries stay readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # not through a link planted in the run dir: appending would write into its target
    with os.fdopen(open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        log.write(text if text.endswith("\n") else text + "\n")


def _write_traceback(path: Path, err: BaseException) -> None:
    append_to_log(path, "".join(traceback.format_exception(err)))


def _first_to_report() -> bool:
    """Whether no other rank of this job has printed a failure yet (each failing rank asks once)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    try:
        return dist.distributed_c10d._get_default_store().add(_REPORTED, 1) == 1
    except (RuntimeError, OSError):  # the store went down with the rank that served it
        return True


def translate(err: BaseException, step: int, collective_timeout_s: float) -> BaseException:
    """The failure a run reports for err: a collective that timed out during `step` (0 before step 1)
    becomes RankHung naming the rank that never arrived; anything else is itself."""
    if not is_collective_timeout(err):
        return err
    hung = RankHung(describe_hang(step, collective_timeout_s, wait_s=min(30.0, collective_timeout_s)))
    hung.__cause__ = err
    return hung


def report_failure(err: BaseException, run_dir: Path, rank: int) -> int:
    """Log err's traceback, print its one line when this rank is the one to, return the exit code."""
    failure: RunFailure = classify(err)
    if not Path(run_dir).is_dir():  # moved or deleted under the run: that is the cause, whatever failed on it
        failure = SaveFailed(f"run dir {run_dir} is gone (moved or deleted while the run trained), so its files "
                             f"could not be written; if it was moved, continue there: megaframe-train "
                             f"train.resume=auto hydra.run.dir=NEW_PATH")
    path = log_path(run_dir, rank)
    try:
        if not Path(run_dir).is_dir():
            raise FileNotFoundError(run_dir)  # no logs/ made at the old path, which a resume would take for the run
        _write_traceback(path, err)
        where = f"; traceback in {path}"
    except OSError:  # an unwritable run dir must not hide the error itself
        where = ""
    if failure.deterministic and not isinstance(failure, JobStopped):
        record_job_stop(failure.exit_code, str(failure))
    # quiet: a rank whose line another prints (parallel/rendezvous.py: one line for a world not joined)
    if not is_peer_failure(err) and not getattr(err, "quiet", False) and _first_to_report():
        rank_note = "" if failure.deterministic or failure.exit_code == ExitCode.REFUSED else f" (rank {rank})"
        print(f"{PROG}: error{rank_note}: {failure} [exit {int(failure.exit_code)}{where}]",
              file=sys.stderr, flush=True)
    return int(failure.exit_code)
