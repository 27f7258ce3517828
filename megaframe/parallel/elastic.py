"""Stopping a job (under torchrun or Ray Train) whose failure a restart would only repeat. (Joining
the process group again after a torchrun restart is parallel/rendezvous.py's.)"""
from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from megaframe.common import json_text
from megaframe.common.atomic_io import atomic_write_text
from megaframe.parallel.rank_zero import decided_by_rank_zero  # torch only when called (2 CPU-s)

if TYPE_CHECKING:
    import torch.distributed as dist


# An earlier attempt's deterministic failure, kept in torchrun's agent store: shared by every node
# and every restart of this job, and gone with the job, so a new launch in the same run dir trains.
STOP_KEY = "megaframe/job_stop"


def _agent_store() -> Optional[dist.Store]:
    """A client of torchrun's agent store (MASTER_ADDR:MASTER_PORT), None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30))


# Under Ray Train there is no agent store: the stop is a file in the run directory (shared by
# every worker and attempt), named by this variable in the workers; the driver removes it before
# the first attempt, so a new launch in the same run dir trains.
STOP_FILE_ENV = "MEGAFRAME_JOB_STOP_FILE"


def record_job_stop(exit_code: int, message: str) -> bool:
    """Tell later restart attempts of this job (torchrun's --max-restarts, Ray's FailureConfig) not
    to train: they exit with exit_code and message at once. Returns whether it was recorded (False
    outside torchrun and Ray, where no restart can follow)."""
    record = json.dumps({"exit_code": int(exit_code), "message": message})
    if stop_file := os.environ.get(STOP_FILE_ENV):
        return _write_stop_file(stop_file, record)  # several ranks, on several hosts, may record the same stop
    try:
        store = _agent_store()
        if store is None:
            return False
        store.set(STOP_KEY, record)
        return True
    except (RuntimeError, OSError):  # the agent is gone: there is no restart to stop either
        return False


# what rank 0 of an elastic torchrun job records in the stop file once its run has ended normally
JOB_FINISHED = "the job's run ended normally on its other nodes"


def record_job_finished() -> None:
    """Rank 0 of an elastic torchrun job (the stop file's path set), its run ended normally: a node
    that joins after it (it came late, or SLURM restarted it) and finds the rendezvous closed ends
    with 0 and says so, where it was exit 1. Restart attempts never read it (job_stop takes
    deterministic failures only), and rank 0 of a new run under the same id removes it
    (forget_job_finished)."""
    if stop_file := os.environ.get(STOP_FILE_ENV):  # unwritable: a late node ends with the rendezvous's error
        _write_stop_file(stop_file, json.dumps({"exit_code": 0, "message": JOB_FINISHED}))


def _write_stop_file(stop_file: str, record: str) -> bool:
    """The record in RUN_DIR/.job_stop/ (launch/elastic.py), atomically; whether it was written."""
    try:
        Path(stop_file).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(stop_file), record)
        return True
    except OSError:
        return False


def forget_job_finished() -> None:
    """Rank 0 as an elastic job's run starts: a finished record of an earlier run under the same
    rendezvous id (a requeued SLURM job keeps its id) is not this run's end."""
    if (stop_file := os.environ.get(STOP_FILE_ENV)) and read_stop_file(stop_file, finished=True) == (0, JOB_FINISHED):
        Path(stop_file).unlink(missing_ok=True)


def job_stop() -> Optional[tuple[int, str]]:
    """(exit code, message) when an earlier attempt of this torchrun or Ray job stopped it, else None."""
    if stop_file := os.environ.get(STOP_FILE_ENV):
        # rank 0 reads and every rank takes its answer: a node whose file system has not yet shown it
        # the file must not train on while the others stop (it would hang them until the timeout)
        return decided_by_rank_zero(lambda: read_stop_file(stop_file))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return None
    store = _agent_store()
    if store is None or not store.check([STOP_KEY]):
        return None
    stop = json.loads(store.get(STOP_KEY))
    return int(stop["exit_code"]), str(stop["message"])


def read_stop_file(path: str, finished: bool = False) -> Optional[tuple[int, str]]:
    """The stop an earlier attempt recorded in the run dir, or None; finished: a finished job's
    record too, (0, JOB_FINISHED). The file is megaframe's own or nothing: not through a link, a few
    KiB at most, a documented deterministic exit code, and its message is quoted short and sanitised
    (a planted file must not write the job log or choose the exit code)."""
    from megaframe.common.failures import ExitCode
    from megaframe.common.safe_files import quote, read_capped

    try:
        stop = json_text.loads(read_capped(Path(path), 1 << 16))
        code, message = stop["exit_code"], stop["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    deterministic = (ExitCode.DIVERGED, ExitCode.BAD_DATA, ExitCode.BAD_CHECKPOINT, ExitCode.MISSING_SYSTEM)
    if finished and code == ExitCode.OK and not isinstance(code, bool):
        return ExitCode.OK, JOB_FINISHED
    if not isinstance(message, str) or isinstance(code, bool) or code not in deterministic:
        return None
    return code, quote(message, 1000)
