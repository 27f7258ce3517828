"""The sharded layer of the layout-free format: every rank writes what it owns, any layout reads
what it needs.

A tensor (a parameter under its canonical name, or `exp_avg.NAME`, `exp_avg_sq.NAME`,
`master.NAME`) is stored as chunks: boxes of the full, unpadded tensor (checkpoint/boxes.py),
each in some rank's file. In a checkpoint directory:
  shards/rankNNNNN.safetensors   one rank's chunks, fp32, written one tensor at a time
  shards/rankNNNNN.json          that rank's record: its chunks' boxes, and the bytes and sha256 of
                                 the files it wrote (hashed by that rank as it wrote them)
  index.json                     every tensor's shape, the group file holding its chunks, and whether
                                 its rows are a vocabulary a layout may pad ("pad_rows": declared)
  index/GROUP.json               the chunks of one layer's tensors (GROUP: blocks.N, embed, final_norm,
                                 head), merged from the records at publication
A rank resuming reads index.json (a line per tensor) and the group files of the layers it holds,
not every chunk of the model (at gpt_1t's 3,072 ranks the chunk list runs to about 10^5 entries).
A reader intersects the boxes it needs with the stored chunks and reads only those slices
(memory-mapped). Version-1 checkpoints (whole tensors in model.safetensors / optimizer.safetensors,
as the HF converter wrote them before 2026-12-01) are read through the same index, each tensor one chunk.

Why not torch.distributed.checkpoint: its metadata file is a pickle (the format promises that
nothing is unpickled), and ZeRO's flat partitions are not rectangular pieces of a parameter, so
they would need re-cutting into boxes anyway; the boxes here are that re-cutting, and safetensors
slices do the reading.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from megaframe.checkpoint import universal
from megaframe.checkpoint.boxes import Box, intersect
from megaframe.checkpoint.coverage import coverage_problem
from megaframe.checkpoint.stream import write_streaming
from megaframe.checkpoint.universal import CheckpointError, _atomic_json
from megaframe.common import json_text
from megaframe.common.launch_env import usable_cores

if TYPE_CHECKING:
    from megaframe.checkpoint.staging import Snapshot

SHARDS_DIR = "shards"
INDEX_FILE = universal.INDEX_FILE
INDEX_DIR = "index"


def index_group(key: str) -> str:
    """The group file of a stored tensor: its parameter's layer (blocks.N, or embed / final_norm /
    head), whatever the optimizer prefix (exp_avg., exp_avg_sq., master.)."""
    name = key.split(".", 1)[1] if universal.is_optimizer_key(key) else key
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def shard_file(rank: int, optimizer: bool = False) -> str:
    """Rank `rank`'s weights file, or (optimizer) the file of its optimizer state and fp32 masters: apart,
    so a reader of the weights alone (megaframe-convert, load_model) verifies and reads the weights'
    files, not the state three times their size beside them (AdamW's moments and masters)."""
    return f"{SHARDS_DIR}/rank{rank:05d}{'.optimizer' if optimizer else ''}.safetensors"


def record_file(rank: int) -> str:
    return f"{SHARDS_DIR}/rank{rank:05d}.json"


@dataclass
class Piece:
    """One chunk a rank writes: tensor `key` (full shape `full_shape`), the box it covers, and how
    to make its fp32 values (called when the writer reaches it; a view or a one-tensor copy)."""

    key: str
    full_shape: tuple[int, ...]
    box: Box
    values: Callable[[], torch.Tensor]


def chunk_key(key: str, box: Box) -> str:
    return f"{key}@{','.join(map(str, box.offset))}"


def write_rank_shard(directory: Path, rank: int, pieces: list[Piece]) -> dict:
    """Write this rank's chunks to shards/rankNNNNN.safetensors; return its record (not yet on disk:
    write_record publishes it once the rank's other files are written too)."""
    record: dict = {"rank": rank, "files": {}, "tensors": {}}
    if not pieces:
        return record
    by_name = {chunk_key(p.key, p.box): p for p in pieces}
    if len(by_name) != len(pieces):
        raise ValueError("two pieces of the same tensor start at the same offset")
    (Path(directory) / SHARDS_DIR).mkdir(parents=True, exist_ok=True)

    def produce(name: str) -> torch.Tensor:
        piece = by_name[name]
        return piece.values().reshape(piece.box.shape).float()

    for optimizer in (False, True):
        names = [name for name, p in by_name.items() if universal.is_optimizer_key(p.key) == optimizer]
        if not names:
            continue
        rel = shard_file(rank, optimizer)
        size, sha = write_streaming(Path(directory) / rel, [(name, torch.float32, by_name[name].box.shape)
                                                            for name in names], produce)
        record["files"][rel] = {"bytes": size, "sha256": sha}
        for name in names:
            piece = by_name[name]
            entry = record["tensors"].setdefault(piece.key, {"shape": list(piece.full_shape), "chunks": []})
            entry["chunks"].append({"file": rel, "key": name, "offset": list(piece.box.offset),
                                    "shape": list(piece.box.shape)})
    return record


def rank_writer(directory: Path, rank: int, pieces: list[Piece], full_state: Optional[dict[str, Any]],
                tokenizer_dir: Optional[Path] = None) -> Callable[[], dict]:
    """What writes one rank's part of a save: its shard, then (global rank 0, full_state given)
    state.json and the tokenizer copy; the function returns the rank's record. Called at once, or
    later on a background thread (an async save: the pieces then hold host copies)."""
    def write() -> dict:
        record = write_rank_shard(directory, rank, pieces)
        if full_state is not None:
            universal.write_state(directory, full_state, tokenizer_dir)
        return record
    return write


def write_or_defer(write: Callable[[], dict], snapshot: Optional["Snapshot"]) -> Union[dict, Callable[[], dict]]:
    """A synchronous save writes now and returns the record; a background one (snapshot: its host copies
    queued) returns the function that waits for the copies, then writes."""
    if snapshot is None:
        return write()
    wait = snapshot.ready()

    def write_when_copied() -> dict:
        wait()
        return write()
    return write_when_copied


def check_stored(reader: "ShardReader", key: str, full_shape: tuple[int, ...]) -> None:
    """CheckpointError unless the checkpoint holds tensor `key` at `full_shape` (the model.* config
    decides both)."""
    if key not in reader:
        raise CheckpointError(f"checkpoint {reader.directory} has no tensor {key}; the model.* config must "
                              f"match the checkpoint's state.json")
    if reader.shape(key) != tuple(full_shape):
        raise CheckpointError(f"{key}: the checkpoint holds shape {list(reader.shape(key))}, this model needs "
                              f"{list(full_shape)}; the model.* config must match the checkpoint's state.json")


def write_record(directory: Path, record: dict) -> None:
    """Publish a rank's record (atomic: its presence says the rank's files are complete)."""
    (Path(directory) / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    _atomic_json(Path(directory) / record_file(record["rank"]), record)


def wait_for_records(directory: Path, world: int, timeout_s: float) -> None:
    """Block until every rank's record is in `directory` (a background save: the ranks finish their
    writes on their own threads); CheckpointError naming the missing ranks after timeout_s."""
    deadline = time.monotonic() + timeout_s
    missing, pause = list(range(world)), 0.05
    while True:
        # only the ranks not yet seen, and less often as the wait goes on: at thousands of ranks a stat
        # of every record every 50 ms was tens of thousands of metadata requests a second on Lustre/NFS
        missing = [r for r in missing if not (Path(directory) / record_file(r)).is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint {directory}: ranks {missing[:8]} did not finish writing their "
                                  f"shards within {timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(pause * 1.5, 1.0)


def merge_records(directory: Path, world: int) -> dict[str, dict]:
    """Rank 0 at publication: merge the ranks' records into index.json (refusing a tensor whose
    chunks do not cover it exactly) and return {file: {bytes, sha256}} the ranks reported."""
    directory = Path(directory)
    files: dict[str, dict] = {}
    tensors: dict[str, dict] = {}
    for rank in range(world):
        record = json_text.loads((directory / record_file(rank)).read_text())
        files.update(record["files"])
        for key, entry in record["tensors"].items():
            merged = tensors.setdefault(key, {"shape": entry["shape"], "chunks": []})
            if merged["shape"] != entry["shape"]:
                raise CheckpointError(f"{key}: ranks disagree on its shape ({merged['shape']} vs {entry['shape']})")
            merged["chunks"].extend(entry["chunks"])
    for key, entry in tensors.items():
        if problem := coverage_problem(tuple(entry["shape"]), entry["chunks"]):
            raise CheckpointError(f"{key}: {problem}; the save is incomplete (a layout the writer does not cover)")
    if tensors:
        groups: dict[str, dict] = {}
        for key, entry in sorted(tensors.items()):
            groups.setdefault(index_group(key), {})[key] = entry["chunks"]
        (directory / INDEX_DIR).mkdir(exist_ok=True)
        for group, chunks in groups.items():
            _atomic_json(directory / INDEX_DIR / f"{group}.json", chunks)
        _atomic_json(directory / INDEX_FILE, {
            "padding": PADDING_DECLARED,
            "tensors": {key: {"shape": entry["shape"], "group": index_group(key), "pad_rows": pads_rows_by_name(key)}
                        for key, entry in sorted(tensors.items())}})
    return files


# index.json says which tensors a layout may pad (rows past the stored vocabulary, read as zeros);
# an index without this marker predates the declaration and gets the rule it was written under
PADDING_DECLARED = "declared"


def pads_rows_by_name(key: str) -> bool:
    """Whether stored tensor `key` has the vocabulary as its rows (the embedding, the LM head and
    their optimizer state): the only tensors whose reads may reach past the stored rows."""
    from megaframe.model.spec import VOCAB_PARAMS

    return (key.split(".", 1)[1] if universal.is_optimizer_key(key) else key) in VOCAB_PARAMS


class ShardReader:
    """Read boxes of stored tensors from a checkpoint directory (version 2 through index.json,
    version 1 through its two whole-tensor files). Use as a context manager: it keeps the files
    it touched open (memory-mapped) until exit."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()
        self._chunks: dict[str, list] = {}  # key -> its chunks, filled group by group as they are needed
        self._covered: set[str] = set()  # keys whose chunks were checked to tile the tensor
        self._declared = False  # index.json declares its padded tensors (else the name rule)
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            index = universal.read_json(index_path, f"checkpoint {directory}: {INDEX_FILE}")
            self.tensors = index.get("tensors") if isinstance(index, dict) else None
            self._declared = isinstance(index, dict) and index.get("padding") == PADDING_DECLARED
            if not isinstance(self.tensors, dict) or not all(_entry_ok(e) for e in self.tensors.values()):
                raise CheckpointError(f"checkpoint {directory}: {INDEX_FILE} is damaged (its tensor table is not "
                                      f"{{name: {{shape, group}}}}); use an earlier checkpoint")
        else:
            self.tensors = {}
            for filename in (universal.MODEL_FILE, universal.OPTIMIZER_FILE):
                if (self.directory / filename).is_file():
                    for key, meta in universal.safetensors_header(self.directory / filename).items():
                        self.tensors[key] = {"shape": meta["shape"]}
                        self._chunks[key] = [{"file": filename, "key": key, "offset": [0] * len(meta["shape"]),
                                              "shape": meta["shape"]}]

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Close the files opened so far: their mapped pages leave this process's memory (a rank
        loading parameter by parameter holds one parameter's pages at a time)."""
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def chunks(self, key: str) -> list[dict]:
        """The stored chunks of tensor `key` (reads its group's index file the first time), checked
        to tile the tensor exactly: CheckpointError (exit 5) naming it for a gap, an overlap or a
        chunk out of bounds, which would otherwise load as zeros or as the wrong values."""
        if key not in self._chunks:
            rel = f"{INDEX_DIR}/{self.tensors[key]['group']}.json"
            path = universal.inside(self.directory, rel, INDEX_FILE)
            group = universal.read_json(path, f"checkpoint {self.directory}: {rel}")
            if not isinstance(group, dict):
                raise CheckpointError(f"checkpoint {self.directory}: {rel} is damaged (not a table of chunk lists)")
            self._chunks.update(group)
            if key not in self._chunks:
                raise CheckpointError(f"checkpoint {self.directory}: {rel} has no chunks of {key}")
        if key not in self._covered:
            if problem := coverage_problem(self.shape(key), self._chunks[key]):
                raise CheckpointError(f"checkpoint {self.directory}: tensor {key}: {problem}; the checkpoint is "
                                      f"damaged: use an earlier one (train.resume=PATH to train on)")
            self._covered.add(key)
        return self._chunks[key]

    def pads_rows(self, key: str) -> bool:
        """Whether reads of `key` may reach past its stored rows (a layout's vocabulary padding, read
        as zeros): as index.json declares it, or by name for checkpoints written before it did."""
        return self.tensors[key].get("pad_rows") is True if self._declared else pads_rows_by_name(key)

    def _handle(self, rel: str, key: str = ""):
        if rel not in self._handles:
            universal.inside(self.directory, rel, INDEX_FILE)
            try:
                handle = universal.open_tensors(self.directory, rel)
            except CheckpointError:
                raise
            except Exception as err:  # safetensors' own errors (truncated, garbage header) are no OSError
                raise CheckpointError(f"checkpoint {self.directory}: {rel} (holding tensor {key}) is not a readable "
                                      f"safetensors file ({universal.quote(err)}); use an earlier "
                                      f"checkpoint") from None
            self._handles[rel] = self._stack.enter_context(handle)
        return self._handles[rel]

    def _slice(self, key: str, chunk: dict, src: tuple) -> torch.Tensor:
        """The `src` slice of a chunk of `key`, after checking that its file holds it at the shape the
        index says."""
        handle = self._handle(chunk["file"], key)
        try:
            part = handle.get_slice(chunk["key"])
            if list(part.get_shape()) != list(chunk["shape"]):
                raise ValueError(f"shape {part.get_shape()}, the index says {chunk['shape']}")
            return part[src].float()
        except Exception as err:  # a missing key or a file that lies about its data
            raise CheckpointError(f"checkpoint {self.directory}: tensor {key}: {chunk['file']} does not hold chunk "
                                  f"{chunk['key'][:80]!r} as indexed ({universal.quote(err)}); the checkpoint is "
                                  f"damaged: use an earlier one") from None

    def read(self, key: str, box: Box, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The fp32 values of `box` of tensor `key`; only past the stored rows of a tensor declared
        padded (this layout's vocabulary padding) are the values zeros; a box that reaches anywhere
        else outside the stored tensor is a CheckpointError. Only the overlapping slices of the
        chunks are read."""
        if key not in self.tensors:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {key}; the model.* config must "
                                  f"match the checkpoint's state.json")
        shape = self.shape(key)
        outside = [d for d, (o, n, full) in enumerate(zip(box.offset, box.shape, shape)) if o < 0 or o + n > full]
        if len(box.shape) != len(shape) or (outside and (outside != [0] or not self.pads_rows(key))):
            raise CheckpointError(f"checkpoint {self.directory}: tensor {key} of shape {list(shape)} is read at "
                                  f"offset {list(box.offset)} shape {list(box.shape)}, outside what it stores; the "
                                  f"model.* config must match the checkpoint's state.json")
        out = torch.zeros(box.shape, dtype=torch.float32) if out is None else out
        for chunk in self.chunks(key):
            stored = Box(tuple(chunk["offset"]), tuple(chunk["shape"]))
            common = intersect(box, stored)
            if common is None:
                continue
            src = tuple(slice(c - s, c - s + n) for c, s, n in zip(common.offset, stored.offset, common.shape))
            dst = tuple(slice(c - b, c - b + n) for c, b, n in zip(common.offset, box.offset, common.shape))
            out[dst] = self._slice(key, chunk, src)
        return out

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor `key` (tools and the converter: one tensor at a time)."""
        shape = self.shape(key)
        return self.read(key, Box((0,) * len(shape), shape))


def _entry_ok(entry: Any) -> bool:
    """An index.json tensor entry: {shape: [whole numbers >= 0], group: name, ...}."""
    return (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry["shape"])
            and isinstance(entry.get("group"), str))


def reader_entry_files(directory: Path) -> set[str]:
    """The files in `directory` that tell ShardReader where tensors are (index.json and the index
    groups; without an index, version 1's two whole-tensor files): a verified manifest must list
    each, or a file planted among them would lead the reader to values nothing verified."""
    directory = Path(directory)
    if not (directory / INDEX_FILE).is_file():
        return {name for name in (universal.MODEL_FILE, universal.OPTIMIZER_FILE) if (directory / name).is_file()}
    # hidden files are not the checkpoint's (write_manifest skips them; a copy made on macOS adds ._*.json)
    return {INDEX_FILE} | {f"{INDEX_DIR}/{p.name}" for p in (directory / INDEX_DIR).glob("*.json")
                           if not p.name.startswith(".")}


def refuse_unlisted(directory: Path, listed, read_too: set[str] = frozenset()) -> None:
    """CheckpointError naming the first of the reader's entry files (reader_entry_files), and of
    `read_too`, that the manifest's `listed` files leave out."""
    if unlisted := sorted((reader_entry_files(directory) | read_too) - set(listed)):
        raise CheckpointError(f"checkpoint {directory}: {unlisted[0]} is not in {universal.MANIFEST_FILE} (a file "
                              f"nothing vouches for); use a checkpoint as megaframe saved it")


def verify_all(directory: Path) -> dict:
    """verify_manifest, refusing an index file the manifest does not list (reader_entry_files)."""
    manifest = universal.verify_manifest(directory)
    refuse_unlisted(directory, manifest["files"])
    return manifest


def verify_for_weights(directory: Path) -> dict:
    """verify_manifest for a reader of the weights alone: every file the manifest lists but those that
    hold optimizer state only (a rank's .optimizer file, AdamW's moments and masters: three times the
    fp32 weights, 840 GB at 70B, hashed before an export could start). The index says which files those
    are, and is itself verified with the rest, so a damaged index that misdirected the choice fails; an
    index or a weights file the manifest does not list (planted beside it) is refused, not read unverified."""
    manifest = universal.read_manifest(directory)
    weights, state = set(), set()
    with ShardReader(directory) as reader:
        for key in reader.keys():
            (state if universal.is_optimizer_key(key) else weights).update(c["file"] for c in reader.chunks(key))
    refuse_unlisted(directory, manifest["files"], read_too=weights)
    skipped = state - weights
    universal.verify_files(directory, {rel: entry for rel, entry in manifest["files"].items() if rel not in skipped},
                           threads=min(8, usable_cores()))
    return manifest


def read_universal(directory: Path, verify: bool = True, optimizer_state: bool = True,
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Optional[dict[str, torch.Tensor]]]:
    """(state, model tensors, optimizer tensors or None), after verifying the manifest.
    optimizer_state=False reads the model alone: a training checkpoint's AdamW moments and master
    copy are about three times the fp32 weights, read to be dropped by whoever wants the model.

    Holds the whole model: for tests and small tools. Ranks read their boxes through ShardReader;
    the converter goes tensor by tensor."""
    directory = Path(directory)
    if verify:
        verify_all(directory) if optimizer_state else verify_for_weights(directory)
    state = universal.read_state(directory)
    model, optimizer = {}, {}
    with ShardReader(directory) as reader:
        for key in reader.keys():
            if not universal.is_optimizer_key(key):
                model[key] = reader.full(key)
            elif optimizer_state:
                optimizer[key] = reader.full(key)
    return state, model, (optimizer or None)
