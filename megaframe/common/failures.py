"""How a run that has started ends when it cannot go on: one exit code per cause, one line for the user.

PROG names the command in that line (and in the refusals before launch).

The codes are documented in docs/failures.md; 2 stays "refused before launch". A failure that
would happen again on a restart (divergence, bad data, a corrupt checkpoint, a missing system
piece) is *deterministic*: a restart by torchrun or Ray must not replay it (see parallel/elastic.py).
"""
from __future__ import annotations

import enum
import errno
import os
from typing import Optional

PROG = "megaframe-train"


class ExitCode(enum.IntEnum):
    """megaframe-train's exit codes."""

    OK = 0
    INTERNAL = 1  # a bug or an unclassified error: the traceback is in RUN_DIR/logs/
    REFUSED = 2  # bad configuration or environment, refused before any rank started
    DIVERGED = 3  # non-finite or spiking steps: train.max_consecutive_skips reached, or train.spike.action=stop
    BAD_DATA = 4  # the dataset cannot be trained on (token ids outside the vocabulary, corrupt files)
    BAD_CHECKPOINT = 5  # the checkpoint to resume from is corrupt or incompatible
    MISSING_SYSTEM = 6  # a system piece failed after launch (a DeepSpeed op that does not load)
    RANK_HUNG = 7  # a rank did not reach a collective within train.collective_timeout_s (or join within join_timeout_s)
    SAVE_FAILED = 8  # a checkpoint (or, on a full disk, any run file) could not be written; the last good one stands


class RunFailure(Exception):
    """A failure after launch with a one-line message (str(err)) and an exit code."""

    exit_code: ExitCode = ExitCode.INTERNAL
    deterministic = False  # a restart would fail the same way

    def __init__(self, message: str):
        super().__init__(message)


class Diverged(RunFailure):
    """Training cannot continue: too many consecutive skipped steps, or a spike with action=stop."""

    exit_code = ExitCode.DIVERGED
    deterministic = True


class BadData(RunFailure):
    """The data cannot be trained on."""

    exit_code = ExitCode.BAD_DATA
    deterministic = True


class BadCheckpoint(RunFailure):
    """The checkpoint to resume from cannot be used."""

    exit_code = ExitCode.BAD_CHECKPOINT
    deterministic = True


class MissingSystemPiece(RunFailure):
    """Something the layout needs from the machine is missing (an op that does not build or load)."""

    exit_code = ExitCode.MISSING_SYSTEM
    deterministic = True


class RankHung(RunFailure):
    """A rank stopped answering; a restart may well succeed (a bad node is replaced)."""

    exit_code = ExitCode.RANK_HUNG


class RunDirInUse(RunFailure):
    """Another live megaframe-train owns the run dir (run_lock.py): refused, as before launch.
    Not recorded as a job stop: the stop record of a Ray job lives in the run dir, which is the
    other run's."""

    exit_code = ExitCode.REFUSED


class SaveFailed(RunFailure):
    """A checkpoint could not be written; a restart after freeing space may well succeed."""

    exit_code = ExitCode.SAVE_FAILED


def save_failure(err: OSError, checkpoint: str, checkpoints_dir: str, stands: str = "") -> SaveFailed:
    """One line for an OSError while writing a checkpoint: which one, why, and the fix. stands: what a
    restart continues from, in words (checkpoint/store.restart_point), when known."""
    reason = err.strerror or type(err).__name__
    where = f" ({err.filename})" if err.filename else ""
    stands = stands or "any earlier checkpoint is untouched: train.resume=auto continues from the newest"
    return SaveFailed(f"writing checkpoint {checkpoint} failed: {reason}{where}; free space or fix permissions in "
                      f"{checkpoints_dir} ({stands})")


def output_failure(err: OSError, output: "str | os.PathLike[str]", *more: "str | os.PathLike[str]") -> str:
    """An OSError while a tool (convert, preprocess) writes `output` (and `more`: a held-out set's
    prefix), in words: why, where, and for a full disk or quota the folders to free. Such a write's
    error names no file (the kernel reports ENOSPC on a write to a file already open), so the
    outputs stand in for it."""
    reason = err.strerror or type(err).__name__
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        outputs = [str(err.filename)] if err.filename else [str(path) for path in (output, *more)]
        folders = list(dict.fromkeys(os.path.dirname(os.path.abspath(path)) for path in outputs))
        return f"{reason} writing {' and '.join(outputs)}; free space in {' or '.join(folders)} or write elsewhere"
    return f"{reason} ({err.filename})" if err.filename else reason


class JobStopped(RunFailure):
    """An earlier attempt of this torchrun or Ray job failed deterministically; this attempt does not retry it."""

    deterministic = True

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = ExitCode(exit_code)


# a run that SIGINT (Ctrl-C), SIGTERM (kill, SLURM's preemption), SIGHUP or SIGUSR1 (SLURM's --signal)
# stopped at a step boundary exits as a shell reports such a process: 128 + the signal's number
# (training/stop_signal.py); SIGQUIT (131) ends every rank at once, unsaved, as the user asked
SIGNAL_STOPS = (130, 143, 129, 138, 131)

_BY_CODE = {failure.exit_code: failure for failure in (Diverged, BadData, BadCheckpoint, MissingSystemPiece, RankHung,
                                                       SaveFailed)}

# gloo and NCCL errors a rank sees when a peer died: consequences, not causes
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "NCCL communicator was aborted", "Socket Timeout", "Connection refused")


def is_peer_failure(err: BaseException) -> bool:
    """Whether an error only reports that another rank went away first."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(marker in text for marker in _PEER_GONE)


def classify(err: BaseException) -> RunFailure:
    """The RunFailure a rank reports for err. Errors of other modules that declare an `exit_code`
    (data's DataError, checkpoint's CheckpointError) map to its failure; anything else is internal."""
    if isinstance(err, RunFailure):
        return err
    if full_disk := _full_disk(err):
        return SaveFailed(f"{full_disk} while the run wrote its files (metrics.jsonl, W&B's offline folder, the fast "
                          f"tier, a checkpoint); free space or raise the quota where it writes, then resume: "
                          f"train.resume=auto continues from the newest checkpoint, which a failed write leaves whole")
    kind = type(err).__name__
    first_line = (str(err).strip().splitlines() or [kind])[0]
    failure = _BY_CODE.get(getattr(err, "exit_code", None))
    return failure(first_line) if failure is not None else RunFailure(f"{kind}: {first_line}")


def _full_disk(err: BaseException) -> Optional[str]:
    """A full disk or quota, in words, wherever the run was writing (a record, a fast-tier part, a
    restored checkpoint: review found each of them exit 1, "an internal error"). torch.save says it
    as a RuntimeError of its zip writer ("unexpected pos"), naming no errno."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{err.strerror}" + (f" ({err.filename})" if err.filename else "")
    text = str(err)
    if isinstance(err, RuntimeError) and "inline_container" in text and ("unexpected pos" in text or "write" in text):
        return f"torch.save could not write its file ({text.strip().splitlines()[0][:120]}): a full disk or a quota"
    return None


def exit_code_of_job(codes: list[Optional[int]]) -> int:
    """The exit code of a job whose ranks exited with `codes`: the documented cause (3-8, else a
    refusal's 2) wins over the ranks that only followed it (1, or killed by a signal: negative)."""
    documented = sorted(c for c in codes if c is not None and ExitCode.DIVERGED <= c <= ExitCode.SAVE_FAILED)
    if documented:
        return documented[0]
    if ExitCode.REFUSED in codes:  # a rank refused to start (a run dir in use under torchrun): its line says why
        return ExitCode.REFUSED
    stopped = {c for c in codes if c}
    # a stop signal: every rank stopped at one boundary; one that was still closing when the first
    # exited was sent the signal again by torchrun's agent (-2, -15, -1, -10), which changes nothing
    if stopped & set(SIGNAL_STOPS) and stopped <= {*SIGNAL_STOPS, *(128 - code for code in SIGNAL_STOPS)}:
        return max(stopped)
    return ExitCode.INTERNAL if any(c for c in codes) else ExitCode.OK
