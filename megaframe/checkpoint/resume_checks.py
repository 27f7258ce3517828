"""What a resume may not do silently: start over on top of an earlier run's history, train on
another data order, or change the layout, engine or schedule without a word.

Three parts, each called from a few lines elsewhere:
- Starting over. A run dir whose metrics.jsonl holds trained steps but whose checkpoints cannot be
  read (storage not mounted: a dangling link, an empty mount point, a missing directory) is refused
  unless train.resume=none says to start over; the launcher asks before launch (exit 2), the trainer
  again after it (exit 5). The one legitimate start-over with records on disk, an attempt that
  crashed before its first checkpoint, is told apart by UNSAVED_MARKER: written in the run dir when
  a run starts from step 0, removed when its first checkpoint is published (checkpoint.publish_dir).
- The data order. The samples of step k are a function of the sequence length, the seed, the
  sources and their weights (and the global batch, checked by the trainer): a checkpoint records
  them (data_record) and a resume that changes them is refused unless
  train.resume_accept_data_change=true, which says in one line what changes.
- What changed. One line naming, old -> new, the layout, engine, max_steps and schedule keys a
  resume changed (run_record / change_line).
"""
from __future__ import annotations

import errno
import hashlib
import math
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megaframe.common import json_text
from megaframe.common.atomic_io import atomic_write_text
from megaframe.checkpoint.universal import CheckpointError, misnamed_checkpoint
from megaframe.parallel.dims import LAYOUT_AXES
from megaframe.common.safe_files import UnsafeFile, open_regular

UNSAVED_MARKER = ".megaframe-unsaved"  # in the run dir: started from step 0, no checkpoint published since
_TAIL_BYTES = 1 << 16  # metrics.jsonl is read from its end: its last records say how far a run got
RESUME_NONE = "start over with train.resume=none"


# ---- starting over ---------------------------------------------------------------------------
def checkpoints_path_problem(checkpoint_dir: Path) -> Optional[str]:
    """A `checkpoints` path no save can write into, in one line, or None: a regular file, or a
    link whose target is gone (shared storage not mounted on this node)."""
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.is_symlink() and not checkpoint_dir.exists():
        return (f"{checkpoint_dir} is a link to {os.readlink(checkpoint_dir)}, which does not exist (storage not "
                f"mounted on this node?): mount it, or remove the link and {RESUME_NONE}")
    if checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        return (f"{checkpoint_dir} is a file, not a directory: checkpoints are saved into it; move the file away "
                f"(and {RESUME_NONE} if there is no checkpoint to resume from)")
    return None


def last_logged_step(metrics_path: Path) -> Optional[int]:
    """The highest training step (>= 1) among metrics.jsonl's last records, None when it holds none.
    Reads only the file's tail, without following a link megaframe did not make: a link, a FIFO or
    other non-file, or a tail with no whole record, counts as an unknown step (-1): evidence, not
    proof, of earlier steps."""
    try:  # safe_files: a link is not followed, a FIFO planted in its place not waited on
        fd = open_regular(metrics_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except UnsafeFile:
        return -1
    except OSError as err:
        return -1 if err.errno == errno.EACCES else None
    with os.fdopen(fd, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return None
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read().decode("utf-8", errors="replace").splitlines()
    steps = []
    for line in tail:
        try:
            record = json_text.loads(line)
        except ValueError:  # the first, cut line of the tail, or one torn by a crash
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            steps.append(step)
    if not steps:
        return -1
    return max(steps) if max(steps) >= 1 else None  # step 0 alone: an evaluation before training


def _checkpoints_state(checkpoint_dir: Path) -> str:
    """Why no checkpoint can be read from checkpoint_dir, in a few words."""
    if not checkpoint_dir.exists():
        return "does not exist (moved, deleted, or storage not mounted?)"
    names = sorted(p.name for p in checkpoint_dir.iterdir())
    if not names:
        return "is empty (an unmounted mount point?)"
    if all(name.startswith("tmp-") for name in names):
        return f"holds only unfinished saves ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
    return "holds no complete checkpoint"


def _is_plain_file(path: Path) -> bool:
    """A regular file megaframe wrote, not a link someone planted (lstat: never followed)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def start_over_problem(run_dir: Path, checkpoint_dir: Path, resume: str) -> Optional[str]:
    """Why this run may not start from step 0 in run_dir, in one line, or None. Call it once the
    resume found no checkpoint (train.resume=auto) or will not look (none, PATH): a `checkpoints`
    no save can write into is refused in every mode; under auto, so are trained steps in
    metrics.jsonl with no checkpoint they lead up to, unless UNSAVED_MARKER says the earlier attempt
    never published one (it crashed before its first save and starts over)."""
    run_dir, checkpoint_dir = Path(run_dir), Path(checkpoint_dir)
    if problem := checkpoints_path_problem(checkpoint_dir):
        return f"train.resume={resume}: {problem}"
    if resume != "auto" or _is_plain_file(run_dir / UNSAVED_MARKER):
        return None
    last = last_logged_step(run_dir / "metrics.jsonl")
    if last is None:
        return None
    steps = f"up to step {last}" if last > 0 else "of earlier steps"
    return (f"train.resume=auto: {run_dir / 'metrics.jsonl'} holds records {steps}, but {checkpoint_dir} "
            f"{_checkpoints_state(checkpoint_dir)}: mount or restore the checkpoints to resume, or {RESUME_NONE}")


def resume_path_problem(path: Path) -> Optional[str]:
    """train.resume=PATH naming a run directory or a Hugging Face model rather than a checkpoint (or a
    checkpoints/ directory with its `latest`): one line with the fix before launch. Both failed after
    launch with "no manifest.json: ... resume from an earlier checkpoint" (exit 5), the wrong fix."""
    kind = misnamed_checkpoint(path) if path.is_dir() else None  # a missing path: the ranks' own line
    if kind == "run":
        return (f"train.resume={path}: a run directory, not a checkpoint; resume from its checkpoints with "
                f"train.resume={path / 'checkpoints'} (the newest), or a checkpoint in it such as "
                f"{path / 'checkpoints' / 'global_stepN'}")
    if kind == "hf":
        return (f"train.resume={path}: a Hugging Face model, not a megaframe checkpoint; convert it first "
                f"(megaframe-convert from-hf {path} OUT) and resume from OUT")
    return None


def prelaunch_problem(run_dir: Path, resume: str) -> Optional[str]:
    """start_over_problem() as the launcher can ask it, before any rank starts: for train.resume=auto
    only when run_dir holds no complete checkpoint (which checkpoint verifies is the ranks' job)."""
    run_dir = Path(run_dir)
    checkpoint_dir = run_dir / "checkpoints"
    if resume not in ("auto", "none") and (problem := resume_path_problem(Path(resume))):
        return problem
    if resume == "auto" and checkpoint_dir.is_dir() and any(
            re.fullmatch(r"global_step\d+", p.name) and p.is_dir() for p in checkpoint_dir.iterdir()):
        return None  # a published checkpoint (checkpoint/store.py's names): which one verifies is the ranks' job
    return start_over_problem(run_dir, checkpoint_dir, resume)


def start_over(run_dir: Path, checkpoint_dir: Path, resume: str, metrics, is_logger: bool) -> None:
    """The trainer's start from step 0 (no checkpoint to resume from): rank 0's start_over_problem
    ends every rank with a CheckpointError (exit 5); else, under train.resume=auto, the records of
    an attempt that crashed before its first checkpoint are dropped (they would repeat), and the run
    is marked unsaved until its first checkpoint. metrics: the trainer's MetricsLog."""
    from megaframe.parallel.rank_zero import decided_by_rank_zero

    # a collective (rank 0 reads the run dir): a storage error there is raised on every rank
    problem = decided_by_rank_zero(lambda: start_over_problem(run_dir, checkpoint_dir, resume))
    if problem is not None:
        raise CheckpointError(problem)
    if not is_logger:
        return
    if resume == "auto" and (dropped := metrics.truncate_after(-1)):
        print(f"no checkpoint to resume from: dropped {dropped} metrics records of an earlier attempt that saved none",
              flush=True)
    elif resume != "auto" and (dropped := metrics.truncate_after(math.inf)):
        # train.resume=none keeps the earlier run's records; a line a crash cut short would swallow
        # this run's first record (appended to it) and make the file unreadable as JSON lines
        print(f"dropped {dropped} line(s) of {metrics.path} that are not JSON (cut short by a crash)", flush=True)
    mark_unsaved(run_dir)


def gone_latest_warning(checkpoint_dir: Path, path: Optional[Path]) -> Optional[str]:
    """The warning when `latest` names a checkpoint that is gone (deleted, or a crash mid-swap) and
    the resume falls back to `path`, an older one: the steps after it are trained again."""
    from megaframe.checkpoint.universal import latest_pointer

    try:
        named = latest_pointer(checkpoint_dir)
    except CheckpointError:
        return None  # an edited `latest`: find_latest has said so
    if named is None or path is None or named == path or named.is_dir():
        return None
    return (f"megaframe: warning: {Path(checkpoint_dir) / 'latest'} names {named.name}, which is gone: resuming from "
            f"the newest checkpoint that remains, {Path(path).name} (train.resume=none starts over)")


def mark_unsaved(run_dir: Path) -> None:
    """Rank 0, as a run starts from step 0: until its first checkpoint is published, a crash leaves
    records that a restart may drop (start_over_problem)."""
    atomic_write_text(Path(run_dir) / UNSAVED_MARKER,
                      "this run started from step 0 and has published no checkpoint yet\n")


def clear_unsaved(checkpoint_dir: Path) -> None:
    """Rank 0, once a checkpoint is published into RUN_DIR/checkpoints: from now on records without
    a readable checkpoint mean lost storage, not a fresh start."""
    try:
        (Path(checkpoint_dir).parent / UNSAVED_MARKER).unlink()
    except FileNotFoundError:
        pass


# ---- the data order --------------------------------------------------------------------------
def data_record(seq_length: int, seed: int, data) -> dict[str, Any]:
    """What decides the samples of every step besides the global batch: the sequence length, the
    seed, each training source (file name, samples) and the blend's weights per stage. `data` is
    the trainer's DataSplits."""
    train = data.train
    if data.blended:
        sources = [[name, len(source)] for name, source in zip(train.names, train.sources)]
        stages = [[stage.start_step, list(stage.weights)] for stage in train.stages]
    else:
        sources = [[Path(data.datasets[0].prefix).name, len(train)]]
        stages = [[0, [1.0]]]
    checksums = [_checksum(dataset) for dataset in data.datasets[:len(sources)]]  # the training sources, in order
    tokens_sampled = [_tokens_sampled(dataset) for dataset in data.datasets[:len(sources)]]
    return {"seq_length": seq_length, "seed": seed, "sources": sources, "stages": stages, "blended": data.blended,
            "checksums": checksums, "tokens_sampled": tokens_sampled}


def _checksum(dataset) -> Optional[str]:
    """The build checksum a dataset read when it opened (its header or sidecar: the data is not read
    again), hex; None for a dataset without one."""
    checksum = getattr(dataset, "checksum", None)
    return checksum.hex() if isinstance(checksum, bytes) else None


SAMPLED_WINDOWS, SAMPLED_TOKENS = 16, 256  # places of a source's tokens hashed, and tokens at each


def _tokens_sampled(dataset) -> Optional[str]:
    """A hash of the source's tokens at SAMPLED_WINDOWS places spread over them, hex; None without
    tokens. The build checksum comes from the sidecar or the index, which a .bin copied over another
    of the same size leaves as it was: such a resume trained on other text, exit 0. Hashing the whole
    .bin at every start would read terabytes; these 16 reads of 1 KiB tell another file apart."""
    tokens = getattr(dataset, "tokens", None)
    if tokens is None:
        return None
    hasher = hashlib.blake2b(str(len(tokens)).encode(), digest_size=16)
    span = max(len(tokens) - SAMPLED_TOKENS, 0)
    for window in range(SAMPLED_WINDOWS):
        start = span * window // (SAMPLED_WINDOWS - 1)
        hasher.update(np.ascontiguousarray(tokens[start:start + SAMPLED_TOKENS]).tobytes())
    return hasher.hexdigest()


def _saved_data(state: dict) -> dict[str, Any]:
    """The checkpoint's data record; a checkpoint written before it existed gives what its
    state.json holds (the layout-free one records model.seq_length and the seed), else nothing."""
    if isinstance(state.get("data"), dict):
        return state["data"]
    saved: dict[str, Any] = {}
    if isinstance(state.get("model"), dict) and "seq_length" in state["model"]:
        saved["seq_length"] = state["model"]["seq_length"]
    if "data_seed" in state:
        saved["seed"] = state["data_seed"]
    return saved


def _names(sources: list) -> str:
    return "[" + ", ".join(str(name) for name, _ in sources) + "]"


def data_changes(state: dict, now: dict[str, Any]) -> list[str]:
    """What a resume from `state` (a checkpoint's client state) into `now` (data_record) changes
    in the data order, one 'key old -> new' each; empty when nothing, or when the checkpoint was
    taken before any sample was drawn (step 0: an imported model)."""
    if not state.get("step"):
        return []
    saved = _saved_data(state)
    changes = []
    for key, name in (("seq_length", "model.seq_length"), ("seed", "train.seed")):
        if key in saved and saved[key] != now[key]:
            changes.append(f"{name} {saved[key]} -> {now[key]}")
    key = "data.blend" if now["blended"] or saved.get("blended") else "data.path"
    if "sources" in saved:
        before, after = [list(s) for s in saved["sources"]], now["sources"]
        if [name for name, _ in before] != [name for name, _ in after]:
            changes.append(f"{key} sources {_names(before)} -> {_names(after)}")
        else:
            changes += [f"{key} {name}: {was} -> {samples} training samples (another file, or data.valid_fraction)"
                        for (name, was), (_, samples) in zip(before, after) if was != samples]
            changes += _checksum_changes(key, saved, now)
    if "stages" in saved and [[s, list(w)] for s, w in saved["stages"]] != now["stages"]:
        changes.append(f"{key} weights {_stages(saved['stages'])} -> {_stages(now['stages'])}")
    return changes


def _checksum_changes(key: str, saved: dict, now: dict[str, Any]) -> list[str]:
    """Sources of one name and sample count whose build checksums differ: another file put in the
    place of the one trained on; failing that, whose tokens differ where sampled under the same build
    checksum: a .bin copied over or rewritten in place. Checkpoints written before records held
    checksums (or samples) say nothing of them."""
    return _differing(saved, now, "checksums", lambda name, samples, old, cur: (
        f"{key} {name}: another file of the same name and {samples} training samples (build checksum "
        f"{old[:12]} -> {cur[:12]})")) or \
        _differing(saved, now, "tokens_sampled", lambda name, samples, old, cur: (
            f"{key} {name}: its tokens differ from those trained on, under the same build checksum (a .bin "
            f"copied over or rewritten in place)"))


def _differing(saved: dict, now: dict[str, Any], field: str, say) -> list[str]:
    """say(name, samples, old, new) for each source of one name and sample count whose `field` differs."""
    was, new = saved.get(field), now.get(field)
    if not isinstance(was, list) or not isinstance(new, list) or len(was) != len(new):
        return []
    return [say(name, samples, old, cur)
            for (name, samples), (_, before), old, cur in zip(now["sources"], saved["sources"], was, new)
            if isinstance(old, str) and isinstance(cur, str) and old != cur and before == samples]


def check_data_order(path: Path, state: dict, now: dict[str, Any], accept: bool, is_logger: bool) -> bool:
    """The trainer's check of a resume's data order: a CheckpointError (exit 5) naming what changes,
    or with `accept` (train.resume_accept_data_change) one warning line; returns whether it changes."""
    changes = data_changes(state, now)
    refusal, warning = data_change_problem(path, changes, accept)
    if refusal:
        raise CheckpointError(refusal)
    if warning and is_logger:
        print(warning, file=sys.stderr, flush=True)
    return bool(changes)


def _stages(stages: list) -> str:
    """[0.3, 0.7], or with data.blend_schedule [0.3, 0.7] then [0.5, 0.5] from step 40."""
    parts = [f"{[round(w, 6) for w in weights]}" + (f" from step {start}" if start else "")
             for start, weights in stages]
    return " then ".join(parts)


def data_change_problem(path: Path, changes: list[str], accept: bool) -> tuple[Optional[str], Optional[str]]:
    """(refusal, warning) for the data changes of a resume from `path`: the refusal unless
    train.resume_accept_data_change, else the warning line that says what changes."""
    if not changes:
        return None, None
    said = "; ".join(changes)
    if not accept:
        return (f"train.resume: checkpoint {path} was trained on another data order ({said}); resuming would change "
                f"which samples each step trains on: change them back, or accept it with "
                f"train.resume_accept_data_change=true"), None
    return None, (f"megaframe: warning: train.resume_accept_data_change=true: from step {_next_step(path)} the "
                  f"samples of each step follow the new data order ({said})")


def _next_step(path: Path) -> str:
    name = Path(path).name
    return str(int(name.removeprefix("global_step")) + 1) if name.removeprefix("global_step").isdigit() else "now on"


# ---- what changed ----------------------------------------------------------------------------
_RUN_KEYS = (("backend", "backend"), *((axis, f"parallel.{axis}") for axis in LAYOUT_AXES),
             ("zero", "zero.stage"), ("max_steps", "train.max_steps"),
             ("lr", "optim.lr"), ("min_lr", "optim.min_lr"), ("warmup_steps", "optim.warmup_steps"),
             ("lr_decay", "optim.lr_decay"))


def run_record(cfg, layout) -> dict[str, Any]:
    """The layout, engine and schedule a checkpoint was trained with (cfg: TrainConfig)."""
    o = cfg.optim
    return {"backend": cfg.backend.name, **layout.grid.degrees(), "zero": cfg.zero.stage,
            "max_steps": cfg.train.max_steps, "lr": o.lr, "min_lr": o.min_lr, "warmup_steps": o.warmup_steps,
            "lr_decay": o.lr_decay}


def _saved_run(state: dict) -> dict[str, Any]:
    """The checkpoint's run record, or what its layout record says (checkpoints written before)."""
    if isinstance(state.get("run"), dict):
        return state["run"]
    layout = state.get("layout")
    if not isinstance(layout, dict):
        return {}
    saved = {axis: layout.get(axis, 1) for axis in LAYOUT_AXES}
    saved["backend"] = layout.get("engine", "deepspeed")  # the plain engine writes DeepSpeed's record
    if "zero_stage" in layout:
        saved["zero"] = layout["zero_stage"]
    return saved


def change_line(path: Path, state: dict, now: dict[str, Any]) -> Optional[str]:
    """One line saying, old -> new, what this resume changes of the checkpoint's layout, engine,
    max_steps and schedule; None when nothing (or when the checkpoint does not say)."""
    saved = _saved_run(state)
    changes = [f"{name} {saved[key]} -> {now[key]}" for key, name in _RUN_KEYS
               if key in saved and saved[key] != now[key]]
    if not changes:
        return None
    stretched = any(key in saved and saved[key] != now[key] for key in ("max_steps", "warmup_steps", "lr_decay",
                                                                        "lr", "min_lr"))
    note = "; the learning-rate schedule follows the new values from here" if stretched else ""
    return f"changed since {Path(path).name}: {', '.join(changes)}{note}"
