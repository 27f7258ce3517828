"""The layout-free ("universal") checkpoint format: named fp32 tensors in safetensors.

Tensors are the canonical parameters (the tp=1 GPT's names, vocabulary unpadded) and, with the
optimizer, each state tensor its optimizer names (megaframe/optim/table.py: AdamW's exp_avg.<name>,
exp_avg_sq.<name>; Muon's momentum_buffer.<name>) and master.<name> (omitted in fp32); state.json's
"optimizer_record" says whose (none: AdamW's). Two versions:
  2 (training saves, and the HF converter's since 2026-12-01) every rank writes the chunks it owns:
                       shards/, index.json, index/ (checkpoint/sharded.py); the converter whole tensors
  1 (the HF converter before) whole tensors: model.safetensors, optional optimizer.safetensors
Both hold
  state.json             {"format": "megaframe-universal", "version", "step", "consumed_samples", "model", ...}
  manifest.json          written last: bytes + sha256 of every other file (a shard's hash is computed by
                         the rank that wrote it)
  tokenizer/             optional copy of a Hugging Face tokenizer directory
Every file is fsync'd by the process that wrote it, and each directory before it is renamed into
place (replace_dir): an atomic rename alone may reach the disk before the data it names.
Nothing here is unpickled: tensors come from safetensors, the rest is JSON. No torch.distributed in
this module: engine and rank code lives in backends/deepspeed/state_io.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megaframe.common import json_text
from megaframe.common.failures import ExitCode
from megaframe.common.launch_env import usable_cores
from megaframe.common.atomic_io import atomic_write_text, fsync_dir, fsync_file
from megaframe.common.safe_files import not_a_file, quote, read_capped
from megaframe.checkpoint.coverage import whole_number
from megaframe.common.file_hash import hash_file
from megaframe.common.tokenizer_files import tokenizer_files
from megaframe.optim.table import ALL_TENSOR_STATE

FORMAT, VERSION, SHARDED_VERSION = "megaframe-universal", 1, 2
READABLE_VERSIONS = (VERSION, SHARDED_VERSION)
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, MANIFEST_FILE = "model.safetensors", "optimizer.safetensors", "state.json", "manifest.json"
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's (optim/table.py), which DeepSpeed's engine steps
MASTER_KEY = "master"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupted, truncated, incompatible. The message is one line."""

    exit_code = ExitCode.BAD_CHECKPOINT  # after launch (megaframe/common/failures.py)


def file_entry(path: Path) -> dict:
    """A manifest entry: the file's size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": hash_file(path)}


def safetensors_header(path: Path) -> dict[str, dict]:
    """{name: {"shape", "dtype"}} from a safetensors header, without reading tensor data.

    Raises CheckpointError when the header itself is unreadable (truncated or overwritten file)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > os.path.getsize(path) - 8:
                raise ValueError(f"header length {length} exceeds the file")
            header = json_text.loads(f.read(length))
        tensors = {name: meta for name, meta in header.items() if name != "__metadata__"}
        # the data the header promises must be there: a truncated file failed later, in the middle
        # of a conversion, with safetensors' own traceback
        data_end = max((int(meta["data_offsets"][1]) for meta in tensors.values()), default=0)
        if 8 + length + data_end > os.path.getsize(path):
            raise ValueError(f"its tensors need {8 + length + data_end} bytes, the file has {os.path.getsize(path)}: "
                             f"truncated")
        shapes = {name: {"shape": meta["shape"], "dtype": meta["dtype"]} for name, meta in tensors.items()}
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    return shapes


JSON_CAP = 1 << 26  # 64 MiB: a manifest or index of thousands of ranks' files is a few MiB
LATEST_CAP = 4096  # `latest` holds one directory name


def read_json(path: Path, what: str) -> Any:
    """The JSON value of a checkpoint's own file (not a link, at most JSON_CAP bytes);
    CheckpointError naming `what` when it cannot be read or parsed, quoting nothing of its content."""
    try:
        return json_text.loads(read_capped(path, JSON_CAP))
    except OSError as err:
        raise CheckpointError(f"{what} cannot be read ({err.strerror or err})") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError: position only, no content
        raise CheckpointError(f"{what} is not valid JSON ({quote(err, 100)}): damaged; use an earlier "
                              f"checkpoint") from None


def _atomic_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def write_manifest(directory: Path, hashed: Optional[dict[str, dict]] = None) -> dict:
    """Record every file under `directory` (sizes, sha256, safetensors tensor lists); written last.

    hashed: {file: {bytes, sha256}} already computed by the ranks that wrote those files (their
    shards): taken as they are, so the publishing rank hashes only the small files it wrote itself."""
    directory = Path(directory)
    hashed = hashed or {}
    files, tensors = {}, {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST_FILE or path.name.startswith("."):
            continue
        if rel in hashed:
            files[rel] = {"bytes": hashed[rel]["bytes"], "sha256": hashed[rel]["sha256"]}
            continue
        files[rel] = file_entry(path)
        if rel.endswith(".safetensors"):
            tensors[rel] = safetensors_header(path)
    if missing := sorted(set(hashed) - set(files)):
        raise CheckpointError(f"checkpoint {directory}: {missing[0]} was reported written but is not there")
    manifest = {"files": files, "tensors": tensors}
    _atomic_json(directory / MANIFEST_FILE, manifest)
    return manifest


def inside(directory: Path, rel: str, source: str) -> Path:
    """directory/rel for a name read from disk (`source` says where); CheckpointError when it would
    leave the directory (an absolute path, '..', a link pointing out): a checkpoint is a tree of its own."""
    root = Path(directory).resolve()
    path = (root / rel).resolve() if isinstance(rel, str) else root
    if not isinstance(rel, str) or Path(rel).is_absolute() or path == root or root not in path.parents:
        if isinstance(rel, str) and not Path(rel).is_absolute() and (link := _first_link(Path(directory), rel)):
            # a link someone put there (a shard shared with another copy, a checkpoint on other storage):
            # the name is megaframe's, so "the file was edited" sent the user to a good file (review)
            raise CheckpointError(f"checkpoint {directory}: {link} is a symbolic link (to "
                                  f"{quote(os.readlink(link), 200)}) leading outside {root}; megaframe reads no link "
                                  f"out of a checkpoint: put the files themselves there")
        raise CheckpointError(f"checkpoint {directory}: {source} names {rel!r}, outside the checkpoint directory; "
                              f"the file was edited or is not a megaframe checkpoint")
    return path


def _first_link(directory: Path, rel: str) -> Optional[Path]:
    """The first component of directory/rel that is a symbolic link, if any."""
    path = directory
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            return path
    return None


LATEST_FILE = "latest"


def latest_pointer(save_dir: Path) -> Optional[Path]:
    """The checkpoint a run's checkpoints/ directory names in `latest` (None without the file); it
    may not exist (a crash mid-swap). The name must be a global_stepN directory of save_dir itself:
    anything else, a path that leaves it included, is a CheckpointError."""
    pointer = Path(save_dir) / LATEST_FILE
    if not os.path.lexists(pointer):
        return None
    try:  # not a link, not a FIFO, not a large file: its content goes into no line unchecked
        name = read_capped(pointer, LATEST_CAP).decode("utf-8", "replace").strip()
    except OSError as err:
        raise CheckpointError(f"{pointer} cannot be read ({err.strerror or err}); megaframe writes it as a "
                              f"small file naming global_stepN: delete it") from None
    if not re.fullmatch(r"global_step\d+", name):
        raise CheckpointError(f"{pointer} names {quote(name)!r}, not a checkpoint directory of {save_dir} "
                              f"(global_stepN); the file was edited: fix it or delete it")
    return inside(save_dir, name, str(pointer))


def read_manifest(directory: Path) -> dict:
    """manifest.json of a checkpoint (CheckpointError when absent or unreadable)."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if problem := not_a_file(manifest_path):
        raise CheckpointError(f"checkpoint {directory}: {problem}; the checkpoint was changed since it was saved")
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST_FILE}: it is incomplete (a save that did not "
                              f"finish) or not a megaframe checkpoint")
    manifest = read_json(manifest_path, f"checkpoint {directory}: {MANIFEST_FILE}")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)
            for meta in files.values()):
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST_FILE} is unreadable (its file table is not "
                              f"{{file: {{bytes, sha256}}}}); use an earlier checkpoint")
    return manifest


def verify_files(directory: Path, files: dict[str, dict], threads: int = 1) -> None:
    """Check the listed files (every size, then the sha256s, on `threads` threads: hashlib and file
    reads release the GIL); CheckpointError naming the first bad one in the listed order."""
    directory = Path(directory)
    paths = {}
    for rel, meta in files.items():
        path = paths[rel] = inside(directory, rel, MANIFEST_FILE)
        if problem := not_a_file(path):  # a FIFO or a folder of its name was called missing (review)
            raise CheckpointError(f"checkpoint {directory}: {problem}; the checkpoint was changed since it was "
                                  f"saved")
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {rel} is missing")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {directory} is truncated or corrupted: {rel} has {size} bytes, "
                                  f"the manifest says {meta['bytes']}")
    bad = lambda rel: hash_file(paths[rel]) != files[rel]["sha256"]  # noqa: E731
    if threads > 1 and len(files) > 1:
        with ThreadPoolExecutor(min(threads, len(files))) as pool:
            verdicts = list(pool.map(bad, files))
    else:
        verdicts = (bad(rel) for rel in files)  # lazily: the first bad file ends it
    for rel, wrong in zip(files, verdicts):
        if wrong:
            raise CheckpointError(f"checkpoint {directory} is corrupted: {rel} does not match its sha256 in "
                                  f"{MANIFEST_FILE}")


def verify_manifest(directory: Path) -> dict:
    """Check every file the manifest lists, from one process (the offline tools: megaframe-convert,
    load_model) on up to 8 threads: one thread hashed a 70B AdamW checkpoint's 1.1 TB before
    anything was written. Ranks split the work among themselves instead (checkpoint/store.py)."""
    manifest = read_manifest(directory)
    verify_files(directory, manifest["files"], threads=min(8, usable_cores()))
    return manifest


def write_state(directory: Path, state: dict[str, Any], tokenizer_dir: Optional[Path] = None) -> None:
    """state.json (and a tokenizer copy) of a checkpoint whose tensors are written elsewhere (the
    ranks' shards)."""
    state = {"format": FORMAT, "version": VERSION, **state}
    for key in ("step", "consumed_samples", "model"):
        if key not in state:
            raise ValueError(f"state.json needs '{key}'")
    if tokenizer_dir is not None:  # its tokenizer files only: data.tokenizer may name a model directory
        copy_dir = Path(directory) / "tokenizer"
        copy_dir.mkdir(exist_ok=True)
        for path in tokenizer_files(tokenizer_dir):
            fsync_file(shutil.copy2(path, copy_dir / path.name))
        fsync_dir(copy_dir)
    _atomic_json(Path(directory) / STATE_FILE, state)


def sync_dirs(directory: Path, rels) -> None:
    """fsync `directory` and every directory holding one of the files `rels` (relative to it): the
    entries of files a rank wrote (each file fsync'd by its writer) are durable before it reports them."""
    directory = Path(directory)
    for folder in sorted({(directory / rel).parent for rel in rels} | {directory}):
        fsync_dir(folder)


def write_files(directory: Path, model: dict[str, torch.Tensor], state: dict[str, Any],
                optimizer: Optional[dict[str, torch.Tensor]] = None, tokenizer_dir: Optional[Path] = None) -> None:
    """Write model/optimizer/state (and a tokenizer copy) into an existing directory; no manifest.

    For callers that publish the directory themselves (the trainer's save renames a tmp dir holding
    DeepSpeed's files too); others use write_universal."""
    directory = Path(directory)
    save_file({k: v.detach().float().contiguous() for k, v in model.items()}, str(directory / MODEL_FILE))
    fsync_file(directory / MODEL_FILE)
    if optimizer is not None:
        save_file({k: v.detach().float().contiguous() for k, v in optimizer.items()}, str(directory / OPTIMIZER_FILE))
        fsync_file(directory / OPTIMIZER_FILE)
    write_state(directory, state, tokenizer_dir)


def write_universal(out_dir: Path, model: dict[str, torch.Tensor], state: dict[str, Any],
                    optimizer: Optional[dict[str, torch.Tensor]] = None, tokenizer_dir: Optional[Path] = None) -> Path:
    """Write a complete universal checkpoint at out_dir atomically: tmp dir, manifest last, rename.

    An existing out_dir is replaced only once the new one is complete."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_files(tmp, model, state, optimizer, tokenizer_dir)
        write_manifest(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return replace_dir(tmp, out_dir)


OLD_PREFIX = "tmp-old-"  # a replaced directory, until the swap that replaced it is durable


def _delete(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def replace_dir(tmp: Path, final: Path, discard: Callable[[Path], None] = _delete) -> Path:
    """Rename the complete directory `tmp` to `final`; an existing `final` is moved aside to
    tmp-old-NAME first and discarded only after the swap, so a crash never leaves neither (a crash
    between the two renames is put right by finish_interrupted_swaps). Durable: tmp's entries are
    fsync'd before the rename (its files by their writers), the parent after it. discard(old): what
    becomes of the old copy (or of nothing, where there is none), deleted here unless the caller
    defers it (a checkpoint's goes to the trash, checkpoint/store.py)."""
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    old = final.with_name(f"{OLD_PREFIX}{final.name}")
    if final.exists():
        discard(old)
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)  # before the old copy goes
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)
    discard(old)  # also an interrupted swap's copy, superseded now
    return final


TRASH_PREFIX = "tmp-del-"  # a directory on its way out: the next publish deletes it (store.py empty_trash)


def finish_interrupted_swaps(parent: Path) -> list[Path]:
    """Put right what a crash between replace_dir's two renames left in `parent`: NAME gone, its old
    copy at tmp-old-NAME and the new one at tmp-NAME. The old copy, which `latest` named, is renamed
    back and the new one goes to the trash. A tmp-old-NAME that `latest` names comes back too when
    its tmp-NAME is gone (a user cleared it: a tmp-global_stepN is never a checkpoint). Any other
    tmp-old-NAME (the swap done, or an empty husk a delete left on NFS) goes to the trash. Renames
    only, nothing deleted here: the next publish empties the trash. Before this, a resume fell back
    past NAME (a step saved twice, as a stop right after a resume does) and the aside copy stayed on
    the storage for good. Returns what came back."""
    restored = []
    try:
        named = latest_pointer(parent)
    except CheckpointError:
        named = None  # resume_checks says what is wrong with `latest`
    for old in sorted(Path(parent).glob(f"{OLD_PREFIX}*")):
        name = old.name.removeprefix(OLD_PREFIX)
        final, new = old.with_name(name), old.with_name(f"tmp-{name}")
        # `latest` names it: someone cleared tmp-NAME (review); by name, as `named` is resolved and
        # `parent` may not be (a checkpoints/ linked to shared storage)
        cut_in_two = new.is_dir() or (named is not None and named.name == name)
        if not os.path.lexists(final) and old.is_dir() and not old.is_symlink() and cut_in_two:
            if os.path.lexists(new):
                os.replace(new, trash_name(new.with_name(name)))
            os.replace(old, final)
            restored.append(final)
        else:
            os.replace(old, trash_name(final))
    fsync_dir(parent)
    return restored


def to_trash(path: Path) -> None:
    """Rename `path`, where it exists, to a free tmp-del- name beside it, which the checkpoints' trash
    deletes later (checkpoint/store.py); deleted here where the rename fails (a file system refusing
    it), since a rank that raises here leaves the others at the next barrier until the collective
    timeout."""
    if not os.path.lexists(path):
        return
    try:
        os.replace(path, trash_name(path))
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def trash_name(path: Path) -> Path:
    """A free tmp-del- name for `path` in its folder."""
    trash, n = path.with_name(TRASH_PREFIX + path.name), 1
    while os.path.lexists(trash):
        trash, n = path.with_name(f"{TRASH_PREFIX}{path.name}-{n}"), n + 1
    return trash


def read_state(directory: Path) -> dict[str, Any]:
    """state.json of a universal checkpoint (format and version checked)."""
    path = Path(directory) / STATE_FILE
    state = read_json(path, f"checkpoint {directory}: {STATE_FILE}")
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {directory}: {STATE_FILE} holds no JSON object; use an earlier "
                              f"checkpoint")
    if state.get("format") != FORMAT or state.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {directory}: {STATE_FILE} is format {quote(state.get('format'))!r} "
                              f"version {quote(state.get('version'))!r}; this megaframe reads {FORMAT!r} versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    if problem := _field_problem(state):
        raise CheckpointError(f"checkpoint {directory}: {STATE_FILE}'s {problem}; use an earlier checkpoint")
    named = re.fullmatch(r"global_step(\d+)", Path(directory).name)
    if named and int(named[1]) != state["step"]:  # a step of 10^15 in global_step30 trained on (review)
        raise CheckpointError(f"checkpoint {directory}: {STATE_FILE}'s 'step' is {state['step']}, not the {named[1]} "
                              f"its directory is named after (saves name it after the step): it was edited or "
                              f"renamed; use an earlier checkpoint")
    return state


def _field_problem(state: dict[str, Any]) -> Optional[str]:
    """Which field a resume reads is not of its kind, or None: a hand-edited or planted state.json
    (the manifest can be recomputed) ends the resume with this line and exit 5, not a traceback from
    int() or .get() in the engine's loader."""
    for key, required in (("step", True), ("consumed_samples", True), ("optim_step", False),
                          ("global_batch_size", False)):
        value = state.get(key)
        if (required or value is not None) and not (whole_number(value) and value >= 0):
            return f"'{key}' is {quote(repr(value))}, not a whole number" + (" >= 0" if whole_number(value) else "")
    for key in ("lr_scheduler", "loss_scaler", "layout", "run", "data", "guard"):
        if key in state and not isinstance(state[key], dict):
            return f"'{key}' is {quote(repr(state[key]))[:80]}, not a JSON object"
    last_epoch = state.get("lr_scheduler", {}).get("last_epoch")
    if last_epoch is not None and not whole_number(last_epoch):
        return f"'lr_scheduler.last_epoch' is {quote(repr(last_epoch))}, not a whole number"
    for field, value in state.get("loss_scaler", {}).items():  # the fp16 scaler's numbers
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"'loss_scaler.{quote(str(field))[:40]}' is {quote(repr(value))[:80]}, not a number"
    return None


INDEX_FILE = "index.json"  # version 2's chunk index (checkpoint/sharded.py)


def has_universal(directory: Path) -> bool:
    """Whether the directory holds the layout-free files (state.json and tensors of either version)."""
    directory = Path(directory)
    return (directory / STATE_FILE).is_file() and ((directory / MODEL_FILE).is_file()
                                                   or (directory / INDEX_FILE).is_file())


def misnamed_checkpoint(path: Path) -> Optional[str]:
    """What `path`, given where a checkpoint (or a run's checkpoints/ with its `latest`) is wanted, is
    instead: "missing", "run" (a run directory: it holds checkpoints/), "hf" (a Hugging Face model
    directory) or "unsaved" (a checkpoints/ directory no save has finished in: no `latest`); None
    for anything else (a checkpoint, or a folder of another kind, which its reader judges)."""
    path = Path(path)
    try:
        if not path.exists():
            return "missing"
        if not path.is_dir() or has_universal(path) or (path / MANIFEST_FILE).is_file() or \
                (path / LATEST_FILE).is_file():
            return None
        if (path / "checkpoints").is_dir():
            return "run"
        if (path / "config.json").is_file() and (any(path.glob("*.safetensors"))
                                                 or (path / "pytorch_model.bin").is_file()):
            return "hf"
        if path.name == "checkpoints" and not any(re.fullmatch(r"global_step\d+", p.name) and has_universal(p)
                                                  for p in path.iterdir()):
            return "unsaved"
    except OSError:  # a folder this user cannot read: its reader's error names it
        return None
    return None


def is_optimizer_key(key: str) -> bool:
    """Whether a stored tensor is optimizer state (any optimizer's state by name, master.*) rather than a weight."""
    return key.split(".", 1)[0] in (*ALL_TENSOR_STATE, MASTER_KEY)


def open_tensors(directory: Path, filename: str):
    """A safetensors handle (memory-mapped; get_slice reads only the requested rows/columns)."""
    path = str(Path(directory) / filename)
    if problem := not_utf8(path, "the checkpoint"):  # a folder's name in another encoding: the checkpoint was blamed
        raise CheckpointError(f"checkpoint {quote(str(directory), 200)}: {problem}")
    return safe_open(path, framework="pt", device="cpu")


def not_utf8(path: "str | Path", what: str) -> Optional[str]:
    """Why safetensors cannot open `path`, when its name is not UTF-8 text (bytes of another encoding
    in a folder's name, which Python keeps as surrogates); `what` is what the user may move instead."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return f"its path is not UTF-8 text, which safetensors cannot open; rename the folder (or move {what}) to a " \
               f"UTF-8 name"
    return None
