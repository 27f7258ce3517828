"""Atomic checkpoints: the backend's native files and the layout-free ones, published together.

Layout under RUN_DIR/checkpoints/:
  global_step{N}/      the layout-free shards (checkpoint/sharded.py), rng_rank{R}.pt for every rank,
                       DeepSpeed's own files when asked for (train.native_checkpoint)
  latest               the name of the newest complete checkpoint, replaced atomically and last
A save goes to tmp-global_step{N}/ first. Each rank writes its shard and then its record (the
sha256 of what it wrote, computed by that rank); rank 0 merges the records into index.json, writes
manifest.json and renames the directory into place once every record is there, so a crash mid-save
leaves `latest` pointing at the previous, complete checkpoint. Durable as well as atomic: each rank
fsyncs every file it wrote and the directories holding them before its record says it is done, and
the rename and `latest` are fsync'd in save_dir before older checkpoints are pruned (on Lustre/NFS
a node lost right after a save would otherwise leave `latest` naming data that never reached disk).
Loading verifies the manifest with the files split over the ranks, then reshards into the running
layout.
"""
from __future__ import annotations

import atexit
import functools
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megaframe.checkpoint import sharded, universal
from megaframe.common.file_hash import hashing_shares
from megaframe.checkpoint.universal import CheckpointError
from megaframe.common.atomic_io import atomic_write_text, fsync_dir, fsync_file, sync_filesystem
from megaframe.common.failures import save_failure
from megaframe.common.safe_files import read_capped
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.random import get_rng_states, set_rng_states
from megaframe.parallel.rank_zero import decided_by_rank_zero
from megaframe.checkpoint.resume_checks import clear_unsaved

LATEST = universal.LATEST_FILE
TMP_PREFIX = "tmp-"
LAYOUT_FILE = "layout.json"  # the layout DeepSpeed's own files can be loaded into


def tag_for(step: int) -> str:
    """Directory name of the checkpoint taken after `step` optimizer steps."""
    return f"global_step{step}"


@dataclass
class ResumePoint:
    """Where a load_checkpoint found its checkpoint and what our client state said."""

    path: Path
    step: int
    client_state: dict[str, Any]
    rng_state: dict[str, Any]
    layout_free: bool = False  # read from the layout-free files (into any layout), else the engine's own


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class BackgroundWriter:
    """A rank's checkpoint writing, one save at a time, on a thread (train.async_save): the step
    loop goes on while the rank's shard is written and hashed (and, on rank 0, the checkpoint
    published); the next save and the end of the run wait for it. A failure surfaces at that wait;
    a crash mid-write leaves `latest` on the previous checkpoint, as a synchronous save does."""

    def __init__(self, save_dir: Optional[Path] = None, resume: str = "auto"):
        """save_dir, resume: what a failure says a restart continues from (restart_point)."""
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._save_dir, self._resume = save_dir, resume

    def submit(self, job: Callable[[], None], what: str) -> None:
        self.wait()

        def run():
            try:
                job()
            except BaseException as err:  # re-raised on the training thread by wait()
                self._error = (save_failure(err, what, str(self._save_dir or "the checkpoints directory"),
                                            restart_point(self._save_dir, what, self._resume) if self._save_dir
                                            else "") if isinstance(err, OSError)
                               else RuntimeError(f"train.async_save: writing {what} failed: {err}"))
                self._error.__cause__ = err
        self._thread = threading.Thread(target=run, name=f"megaframe-save-{what}", daemon=False)
        self._thread.start()

    def published(self) -> bool:
        """Block until the save in flight (if any) ends; whether every save so far was published. A
        failure stays for wait() to raise."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._error is None

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


# how long rank 0 waits before a save for pruned checkpoints still being deleted (the others wait at
# the save's barrier meanwhile: far inside any collective timeout)
TRASH_WAIT_S = 60.0


class TrashCollector:
    """Rank 0's deleting of a checkpoints directory's trash (tmp-del-*: pruned checkpoints, replaced
    copies, a crashed save's debris) on a thread of its own, while every rank trains on. A pruned
    checkpoint with its optimizer states is about 16 bytes a parameter (1.1 TB at 70B) in thousands
    of files, minutes of deleting on a parallel file system; rank 0 deleted it before the save's last
    barrier, so every other rank waited there, or in the next step's first collective, as long as
    the delete took (past the collective timeout, a hang reported as rank 0's). One thread at a
    time: a collect while it runs is done by the same thread after the pass in hand; an error is
    one warning line, and the next collect tries again. A daemon, so a failed or stopped run's exit
    does not wait for it; what is left keeps its tmp-del- name and the next resume or save deletes
    it. The next save waits a while for a delete still running (save()'s trash_wait_s), so the
    storage holds train.keep_checkpoints + 1 checkpoints, as when rank 0 deleted in the save, unless
    the delete takes longer: then one line, and the save goes on (the other ranks wait at its first
    barrier meanwhile, so the wait stays far inside the collective timeout). A stop's save does not
    wait: its time is the scheduler's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: Optional[Path] = None
        self._thread: Optional[threading.Thread] = None

    def collect(self, save_dir: Path) -> None:
        """Empty save_dir's trash on the thread (started if none runs)."""
        with self._lock:
            self._pending = Path(save_dir)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="megaframe-trash", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                directory, self._pending = self._pending, None
                if directory is None:
                    self._thread = None
                    return
            try:
                empty_trash(directory)
            except Exception as err:  # a stale handle on NFS: the thread lives on, the next collect retries
                print(f"megaframe: warning: could not empty the checkpoints' trash in {directory} ({err}); "
                      f"the next checkpoint tries again", file=sys.stderr, flush=True)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the trash collected so far is deleted (a clean run's end, after its last barrier),
        or for at most `timeout` seconds (rank 0 before a save); whether it is."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True


def save(backend, save_dir: Path, step: int, client_state: dict[str, Any],
         rng_state: Optional[dict[str, Any]] = None, write_extra: Optional[Callable[[Path], Any]] = None,
         keep: int = 0, native: bool = True, background: Optional[BackgroundWriter] = None,
         before_publish: Optional[Callable[[str], None]] = None, record_timeout_s: float = 1800.0,
         trash: Optional[TrashCollector] = None, trash_wait_s: float = TRASH_WAIT_S) -> Path:
    """Every rank saves its shard and its record; rank 0 then publishes: index, manifest, rename into
    place, `latest`.

    native: the engine's own files too; write_extra(tmp_dir) runs on every rank after them (the
    layout-free shard) and returns the rank's record (checkpoint/sharded.py), or a function that
    writes the shard later and returns it (a snapshot for a background save); background: every
    rank writes on its writer thread and rank 0's thread publishes once every rank's record is
    there, while training goes on; before_publish: a test hook called on each rank with "write"
    before it writes its shard and on rank 0 with "publish" once every shard is written; keep > 0
    sets aside all but the newest `keep` checkpoints once `latest` names the new one; trash: rank
    0's TrashCollector, which deletes them off the step loop (without one, publish deletes them);
    trash_wait_s: how long rank 0 waits, before anything, for a delete still running."""
    save_dir = Path(save_dir)
    tag = tag_for(step)
    tmp = save_dir / (TMP_PREFIX + tag)
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if background is not None:
        background.wait()  # one save in flight at a time
    if rank == 0:
        # a delete slower than the save interval: keep + 1 checkpoints stored, unless it is far slower
        if trash is not None and not trash.wait(trash_wait_s) and trash_wait_s > 0:
            print(f"megaframe: warning: deleting pruned checkpoints in {save_dir} has taken over {trash_wait_s:g} s; "
                  f"saving step {step} beside them (train.keep_checkpoints + 2 for a while)", file=sys.stderr,
                  flush=True)
        if not save_dir.is_dir():
            save_dir.mkdir(parents=True, exist_ok=True)
            fsync_dir(save_dir.parent)  # the run's first checkpoint: save_dir's own entry
        universal.to_trash(tmp)  # debris of a save that crashed: not deleted while the ranks wait
    _barrier()
    native_share: list[Path] = []
    if native:
        backend.save_native(save_dir, tmp.name, client_state)
        sync_filesystem(tmp)  # the engine writes without fsync and names no paths: this node's writes
        native_share = _native_share(tmp, rank, world)
    finish_part = write_rank_part(tmp, rank, client_state, rng_state, write_extra)

    def finish_rank() -> None:
        """This rank's shard (when deferred) and its record, which tells rank 0 it is done."""
        if before_publish is not None:
            before_publish("write")
        record = finish_part()
        # read and hashed here: on an async save's thread, while training goes on (the engine's files are
        # complete once save_native returned; it saves synchronously)
        record["files"].update({path.relative_to(tmp).as_posix(): universal.file_entry(path) for path in native_share})
        universal.sync_dirs(tmp, record["files"])  # its files' entries, before the record reports them
        sharded.write_record(tmp, record)

    final = save_dir / tag

    def publish() -> None:
        sharded.wait_for_records(tmp, world, record_timeout_s)
        if before_publish is not None:
            before_publish("publish")
        publish_dir(tmp, save_dir, step, world, keep, trash)

    if background is not None:
        background.submit((lambda: (finish_rank(), publish())) if rank == 0 else finish_rank, tag)
        return final
    finish_rank()
    _barrier()  # every rank's record is in tmp
    if rank == 0:
        publish()
    _barrier()
    return final


def _native_share(tmp: Path, rank: int, world: int) -> list[Path]:
    """This rank's share of the engine's files in tmp, to hash for the manifest, by bytes
    (hashing_shares: DeepSpeed's optimizer shards dwarf its model-state files). The engine names no
    paths, so rank 0 used to hash them all (16 bytes a parameter with DeepSpeed's optimizer states:
    about 1.1 TB at 70B, while every other rank waited on it past
    the collective timeout). Listed between two barriers: the engine's files are all written before
    any rank lists them, and no rank writes its own files into tmp while another lists. Hashed later,
    by finish_rank (an async save's thread), not in the step loop. Rank 0 lists, and scatters each
    rank its share: every rank listing and stat-ing every file was world² metadata operations on a
    parallel file system's metadata server each save (9M at 3,072 ranks)."""
    _barrier()
    if not dist.is_initialized() or world == 1:
        return _engine_files(tmp)
    shares: Optional[list] = None
    if rank == 0:
        try:
            sizes = {path.relative_to(tmp).as_posix(): path.stat().st_size for path in _engine_files(tmp)}
            shares = [("files", share) for share in hashing_shares(sizes, world)]
        except OSError as err:  # the storage: raised on every rank, none left waiting in the scatter
            shares = [("failed", (err.errno, err.strerror or str(err), str(err.filename or tmp)))] * world
    mine: list = [None]
    dist.scatter_object_list(mine, shares, src=0)
    kind, payload = mine[0]
    if kind == "failed":
        raise OSError(*payload)
    return [tmp / name for name in payload]


def _engine_files(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.rglob("*") if p.is_file() and not p.name.startswith("."))


def write_rank_part(directory: Path, rank: int, client_state: dict[str, Any], rng_state: Optional[dict[str, Any]],
                    write_extra: Optional[Callable[[Path], Any]]) -> Callable[[], dict]:
    """Write what rank `rank` contributes to a checkpoint into `directory`: its RNG states, its
    layout-free shard (write_extra) and, on rank 0, the layout file. Returns the function that
    finishes the part (a deferred shard) and returns the rank's record, not yet written."""
    directory.mkdir(parents=True, exist_ok=True)
    rng_file = directory / f"rng_rank{rank}.pt"
    # the accelerator's default generator too: on CUDA, dropout outside TP regions draws from it
    torch.save({"cpu": torch.get_rng_state(), "accelerator": get_rng_states()[1:], **(rng_state or {})}, rng_file)
    written = write_extra(directory) if write_extra is not None else None
    if rank == 0 and "layout" in client_state:
        atomic_write_text(directory / LAYOUT_FILE, json.dumps(client_state["layout"], sort_keys=True) + "\n")

    def finish() -> dict:
        record = written() if callable(written) else (written or {"rank": rank, "files": {}, "tensors": {}})
        fsync_file(rng_file)  # here: on an async save's thread, not the step loop's
        record["files"][rng_file.relative_to(directory).as_posix()] = universal.file_entry(rng_file)
        return record
    return finish


def publish_dir(tmp: Path, save_dir: Path, step: int, world: int, keep: int = 0,
                trash: Optional[TrashCollector] = None) -> Path:
    """Rank 0, once every rank's record of `world` is in tmp: index, manifest, the rename into
    place and `latest` (then pruning to the newest `keep`). replace_dir fsyncs tmp before the
    rename and save_dir after it, atomic_write_text `latest` and save_dir again: both are on disk
    before an older checkpoint goes. What goes is renamed to the trash here and deleted by `trash`
    on its thread (here without one)."""
    tag = tag_for(step)
    hashed = sharded.merge_records(tmp, world)
    universal.write_manifest(tmp, hashed)  # rank 0 hashes only its own small files
    # re-saving a step keeps the old one until the swap
    final = universal.replace_dir(tmp, save_dir / tag, discard=universal.to_trash)
    atomic_write_text(save_dir / LATEST, tag + "\n")
    clear_unsaved(save_dir)  # the run has a checkpoint now: records without one mean lost storage
    if keep > 0:
        prune(save_dir, keep)
    if trash is None:
        empty_trash(save_dir)
    else:
        trash.collect(save_dir)
    return final


def _complete_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the published global_step{N} directories, oldest first (tmp-* excluded)."""
    found = []
    for path in Path(save_dir).iterdir():
        match = re.fullmatch(r"global_step(\d+)", path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


TRASH_PREFIX = universal.TRASH_PREFIX  # a pruned or superseded checkpoint, renamed before its delete


def prune(save_dir: Path, keep: int) -> list[Path]:
    """Set aside all but the newest `keep` checkpoints, never the one `latest` names; return them.
    Each is renamed to tmp-del-* (a crash mid-delete leaves debris, never a half-deleted global_step
    dir), which empty_trash deletes (publish_dir's caller, on a thread)."""
    current = find_latest(save_dir)
    doomed = [path for _, path in _complete_checkpoints(save_dir)[:-keep] if path != current]
    for path in doomed:
        universal.to_trash(path)
    return doomed


def trash_unfinished_saves(save_dir: Path, spare: Optional[Path] = None) -> list[Path]:
    """Rename to the trash the tmp-global_step{N} directories of saves that never finished: a stop's
    save the scheduler's SIGKILL cut short, at a step the run never saves again, stayed on the
    storage for good (only a later save of the same step set one aside), up to a whole checkpoint's
    bytes each preemption. Rank 0, as a run resumes: no save of this run is in flight (the run lock),
    and the new copy of an interrupted swap (tmp-NAME beside tmp-old-NAME) is kept for
    finish_interrupted_swaps, which only train.resume=auto runs. Only beside a published checkpoint:
    a directory of nothing but unfinished saves is what resume_checks reports (lost storage, or a
    run killed in its first save). `spare`: a directory named to resume from, kept. Returns what went."""
    gone: list[Path] = []
    if not _complete_checkpoints(save_dir):
        return gone
    for path in sorted(Path(save_dir).glob(TMP_PREFIX + "global_step*")):
        swapping = os.path.lexists(path.with_name(universal.OLD_PREFIX + path.name.removeprefix(TMP_PREFIX)))
        if re.fullmatch(TMP_PREFIX + r"global_step\d+", path.name) and path.is_dir() and not swapping \
                and (spare is None or path.resolve() != Path(spare).resolve()):
            universal.to_trash(path)
            gone.append(path)
    return gone


def empty_trash(save_dir: Path) -> None:
    """Delete every tmp-del-* of save_dir: pruned checkpoints, replaced copies, copies an interrupted
    swap left (universal.finish_interrupted_swaps), a crashed save's debris, and those an earlier
    delete could not finish: a crash, or a file still open elsewhere (NFS keeps a deleted open file as
    .nfs*, so its folder cannot go) left one holding a whole checkpoint's bytes that nothing else
    would ever delete. What cannot go now stays for the next call.

    Deleted by `rm -rf` in a child process, which TrashCollector's thread waits on without the GIL:
    a Python rmtree holds the GIL between its unlink calls, and a thread running one slowed a
    step loop of small operations 2-3x for as long as it ran (BENCHMARKS.md), the pace at which a
    GPU's kernels are launched."""
    trash = sorted(str(path) for path in Path(save_dir).glob(TRASH_PREFIX + "*"))
    if not trash:
        return
    argv = ["rm", "-rf", "--", *trash]
    if setpriv := _setpriv():  # killed with this process however it ends (SIGKILL, os._exit): not an orphan
        argv = [setpriv, "--pdeathsig", "KILL", *argv]
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:  # no rm here: deleted in this process
        for path in trash:
            shutil.rmtree(path, ignore_errors=True)
        return
    _DELETING.add(child)
    try:
        child.wait()
    except BaseException:  # a signal's exit during a synchronous save: no rm left behind
        child.kill()
        raise
    finally:
        _DELETING.discard(child)


# rm children still deleting: killed when this process exits (a failed or stopped run leaves none
# behind; what they left keeps its tmp-del- name for the next resume). An exit that skips Python's
# (os._exit of the stop watchdog, SIGKILL) kills them through the parent-death signal util-linux's
# setpriv sets (the thread that started one waits on it, so it is sent only when the process ends);
# where setpriv is missing, such an rm finishes deleting what is trash anyway.
_DELETING: set[subprocess.Popen] = set()


@functools.cache
def _setpriv() -> Optional[str]:
    """util-linux's setpriv, if it has --pdeathsig (2.33 on; an older one would refuse the flag and
    nothing would ever be deleted)."""
    found = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    try:
        said = subprocess.run([found, "--help"], capture_output=True, text=True, timeout=10) if found else None
    except (OSError, subprocess.SubprocessError):
        return None
    return found if said is not None and "--pdeathsig" in said.stdout else None


@atexit.register
def _stop_deleting() -> None:
    for child in list(_DELETING):
        child.kill()


ROLLED_BACK_PREFIX = "rolled-back-"  # checkpoints of a timeline a resume left (set_aside_newer)


def set_aside_newer(save_dir: Path, step: int, resumed: Path) -> list[Path]:
    """The checkpoints of save_dir newer than `step`, the step a run resumed from (a rollback after a
    loss spike, or auto-resume past checkpoints that did not verify), renamed out of the run's lineage
    to rolled-back-<time>-global_stepN: kept for the user, never pruned nor resumed from. Counted by
    step, they made pruning keep the abandoned 4000 and 5000 while deleting each new save but the
    newest, and a damaged `latest` fall back to them. `latest` names the resumed checkpoint when it
    is one of save_dir's. Rank 0 only, before the run's first save. Returns the new names."""
    import time

    newer = [path for found, path in _complete_checkpoints(save_dir) if found > step] if Path(save_dir).is_dir() else []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    moved = []
    for path in newer:
        target = path.with_name(f"{ROLLED_BACK_PREFIX}{stamp}-{path.name}")
        os.replace(path, target)
        moved.append(target)
    if moved:
        fsync_dir(save_dir)
        if Path(resumed).parent.resolve() == Path(save_dir).resolve():
            atomic_write_text(Path(save_dir) / LATEST, Path(resumed).name + "\n")
    return moved


def restart_point(save_dir: Path, failed: str, resume: str) -> str:
    """What a save's failure says stands, in words: the newest checkpoint a train.resume=auto restart
    finds (not the one that failed), else the train.resume=PATH this run started from, else none."""
    try:
        latest = find_latest(save_dir)
    except (CheckpointError, OSError):  # a damaged `latest`: a restart says so itself
        latest = None
    if latest is not None and latest.name == failed:  # the error came after its publish (pruning the oldest)
        return f"{failed} itself was published before the error: train.resume=auto continues from it"
    if latest is not None:
        return f"the previous checkpoint, {latest.name}, is untouched: train.resume=auto continues from it"
    if resume not in ("auto", "none"):
        return f"the checkpoint this run started from, {resume}, is untouched: the same command starts from it again"
    return "no earlier checkpoint was written: a run started again begins at step 0"


def find_latest(save_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint under save_dir, or None. The name in `latest` must be a
    checkpoint directory of save_dir itself: anything else is a CheckpointError. Without `latest`
    (checkpoints copied to a new run dir, the small file deleted) the newest published directory:
    starting over would overwrite complete checkpoints with a new run's."""
    try:
        path = universal.latest_pointer(save_dir)
    except CheckpointError as err:
        raise CheckpointError(f"train.resume: {err}") from None
    if path is not None and path.is_dir():
        return path
    # no `latest`, or it names a directory a crash took away mid-swap (re-save of the same step):
    # the newest published one rather than silently starting over
    complete = _complete_checkpoints(save_dir) if Path(save_dir).is_dir() else []
    return complete[-1][1] if complete else None


def resolve_resume(resume: str, run_checkpoints: Path) -> Optional[Path]:
    """Map train.resume (auto | none | a path) to a checkpoint directory, or None for a fresh start."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(run_checkpoints)
    path = Path(resume)
    latest = find_latest(path)  # a checkpoints/ directory with a `latest` pointer
    return latest if latest is not None else path


def newest_verified(save_dir: Path) -> tuple[Optional[Path], list[str]]:
    """For train.resume=auto: the newest checkpoint under save_dir whose manifest verifies (the one
    `latest` names first, then the others newest first), and why each newer one was skipped.
    Collective: rank 0 lists the candidates and every rank takes its list. Ranks that listed shared
    storage themselves could see different directories (NFS and Lustre clients cache them), and the
    verification's gathers would then pair verdicts on different checkpoints."""
    def listing() -> list[str]:
        try:
            latest = find_latest(save_dir)
            ordered = [] if latest is None else [latest] + [
                path for _, path in reversed(_complete_checkpoints(save_dir)) if path != latest]
        except OSError as err:  # the storage: every rank raises it
            raise OSError(f"train.resume=auto: cannot list {save_dir} ({err.strerror or err}); "
                          f"check the storage and start the run again") from None
        return [str(path) for path in ordered]
    found = decided_by_rank_zero(listing)
    if not found:
        return None, []
    ordered = [Path(path) for path in found]
    skipped = []
    for path in ordered:
        problem = manifest_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name} ({problem})")
    raise CheckpointError(f"train.resume=auto: no checkpoint under {save_dir} verifies: {'; '.join(skipped)}; "
                          f"start over with train.resume=none or a new run directory")


def manifest_problem(path: Path) -> Optional[str]:
    """Check the manifest (every file's size and sha256), the files split over the ranks by bytes
    (hashing_shares); every rank gets the same answer: None when it verifies, else the one-line reason."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    problem, unreadable = None, None
    try:
        files = universal.read_manifest(path)["files"]
        mine = hashing_shares({name: meta["bytes"] for name, meta in files.items()}, world)[_rank()]
        universal.verify_files(path, {name: files[name] for name in mine})
        # rank 0 alone lists the index (one listing of shared storage, not one per rank): a group file
        # the manifest does not list would lead every rank's reader to values nothing verified
        if _rank() == 0:
            sharded.refuse_unlisted(path, files)
    except CheckpointError as err:
        problem = str(err)
    except OSError as err:  # EIO, ESTALE, EACCES on shared storage: said on every rank, not a traceback on
        # one while the others wait in the gather below until the collective timeout
        unreadable = (f"checkpoint {path}: cannot read {err.filename or 'a file'} "
                      f"({err.strerror or type(err).__name__}); check the storage and start the run again")
    answers = [(problem, unreadable)]
    if world > 1:
        answers = [None] * world
        dist.all_gather_object(answers, (problem, unreadable))  # short strings or None per rank
    if unread := next((u for _, u in answers if u is not None), None):
        # not "does not verify": resume=auto would go back to an older checkpoint and set this one aside
        # over what may be a passing storage error; the attempt fails (exit 1) and a restart reads again
        raise OSError(unread)
    return next((p for p, _ in answers if p is not None), None)


def check_model_shape(path: Path, dims) -> None:
    """A layout-free checkpoint resumes only into a model of its parameter shapes: with fewer layers
    it would load and silently drop the rest. CheckpointError naming the first key that differs."""
    from megaframe.model.dims import model_config_from_record, resolve_dims, shape_change

    if not universal.has_universal(path):
        return  # the engine's own loader checks its files against the model
    recorded = universal.read_state(path).get("model")
    if recorded is None:
        return  # written before checkpoints recorded the model: the tensors' own shape checks remain
    try:
        saved = resolve_dims(model_config_from_record(recorded), dims.vocab_size)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"train.resume: checkpoint {path}: {err}") from None
    if change := shape_change(saved, dims):
        key, was, now = change
        raise CheckpointError(f"train.resume: checkpoint {path} holds a model with {key}={was} (this run: {now}); "
                              f"a resume keeps the model's shape: set {key}={was}, or start a new run "
                              f"(train.resume=none or another hydra.run.dir)")


def verify(path: Path) -> None:
    """manifest_problem() as a one-line CheckpointError on every rank."""
    if problem := manifest_problem(path):
        raise CheckpointError(f"train.resume: {problem}; resume from an earlier checkpoint with train.resume=PATH")


def load_any(backend, path: Path, verified: bool = False, trust_pickled: bool = False) -> ResumePoint:
    """Verify the manifest, then resume from the layout-free files (any layout; nothing
    unpickled). This rank's RNG comes back too when the layout is unchanged. Only a checkpoint
    without them (train.universal_checkpoint=false) goes through the backend's own loader, which
    needs the layout they were written in, and only when trust_pickled
    (train.trust_pickled_checkpoint): DeepSpeed's loader unpickles its .pt files with
    weights_only=False, which runs whatever code a crafted file holds."""
    path = Path(path)
    if not verified:
        verify(path)
    layout = backend.layout_record()
    if universal.has_universal(path):
        state = backend.load_full_state(path)
        rng_state = _load_rng(path) if ParallelDims.same_layout(state.get("layout") or {}, layout) else {}
        return ResumePoint(path=path, step=int(state["step"]), client_state=state, rng_state=rng_state,
                           layout_free=True)
    saved = (universal.read_json(path / LAYOUT_FILE, f"train.resume: {path / LAYOUT_FILE}")
             if os.path.lexists(path / LAYOUT_FILE) else None)
    if not backend.has_native(path):
        raise CheckpointError(f"train.resume: {path} holds neither layout-free tensors ({universal.INDEX_FILE}) "
                              f"nor the engine's own files")
    if saved is not None and not ParallelDims.same_layout(saved, layout):
        raise CheckpointError(f"train.resume: checkpoint {path} was written in layout {saved} (now {layout}) and "
                              f"holds no layout-free tensors ({universal.INDEX_FILE}); resume in that layout, or save with "
                              f"train.universal_checkpoint=true")
    if not trust_pickled:
        raise CheckpointError(f"train.resume: checkpoint {path} holds only the engine's pickled files, and unpickling "
                              f"runs any code a crafted file holds; if you wrote it, resume with "
                              f"train.trust_pickled_checkpoint=true (or resume from a layout-free checkpoint)")
    return load(backend, path)


def _load_rng(path: Path) -> dict[str, Any]:
    """This rank's saved RNG states (weights_only: tensors and plain containers only); the default
    generators' applied (CPU, and the accelerator's when the checkpoint holds it)."""
    rng_file = Path(path) / f"rng_rank{_rank()}.pt"
    rng_state = load_tensors_pickle(rng_file) if os.path.lexists(rng_file) else {}
    if "cpu" in rng_state:
        set_rng_states([rng_state["cpu"], *rng_state.get("accelerator", [])])
    return rng_state


def _damaged_native(path: Path, err: BaseException) -> CheckpointError:
    """One line for an engine file that does not unpickle (torch's message, which advises
    weights_only=False, is not relayed)."""
    return CheckpointError(f"train.resume: checkpoint {path}: one of the engine's .pt files is damaged "
                           f"({type(err).__name__}); resume from an earlier checkpoint")


_RNG_CAP = 1 << 24  # 16 MiB: a rank's generator states are kilobytes


def load_tensors_pickle(path: Path) -> dict:
    """A small torch file of tensors and plain containers (weights_only), megaframe's own (not a
    link, at most _RNG_CAP bytes). Damage is a CheckpointError naming the file (exit 5): torch's
    own error says to retry with weights_only=False, which would run what a crafted file holds."""
    try:
        loaded = torch.load(io.BytesIO(read_capped(path, _RNG_CAP)), weights_only=True)
    except OSError as err:
        raise CheckpointError(f"train.resume: {path} cannot be read ({err.strerror or err}); resume from an "
                              f"earlier checkpoint") from None
    except Exception as err:  # UnpicklingError, EOFError, RuntimeError from a truncated zip: all damage
        raise CheckpointError(f"train.resume: {path} is damaged ({type(err).__name__}: not a torch file of "
                              f"plain tensors); resume from an earlier checkpoint") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"train.resume: {path} holds a {type(loaded).__name__}, not the RNG states "
                              f"megaframe saves; resume from an earlier checkpoint")
    return loaded


def load(backend, path: Path) -> ResumePoint:
    """Load model, optimizer, scheduler and this rank's RNG from the backend's own files.

    The returned rng_state holds what the caller passed to save() besides the default generators."""
    path = Path(path)
    try:
        client_state = backend.load_native(path.parent, path.name)
    except (pickle.UnpicklingError, EOFError) as err:
        raise _damaged_native(path, err) from None
    except RuntimeError as err:  # torch's zip reader on a truncated .pt; other RuntimeErrors are no damage
        if "PytorchStreamReader" not in str(err) and "zip archive" not in str(err):
            raise
        raise _damaged_native(path, err) from None
    return ResumePoint(path=path, step=int(client_state["step"]), client_state=client_state,
                       rng_state=_load_rng(path))
