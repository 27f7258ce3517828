"""Reading and writing the converter's directories, never unpickling arbitrary objects.

- Hugging Face model directories: config.json plus safetensors (or, refusing anything but plain
  tensors, torch.load(weights_only=True) for pytorch_model*.bin), single-file or sharded.
- Layout-free megaframe checkpoints, through megaframe/checkpoint/: read in either version (a
  training save's shards, or whole tensors), written as version 2, a training save's format (whole
  tensors as chunks of shards/ files of at most 2 GiB, index.json, state.json, manifest.json, +
  tokenizer/). Tensors go one at a time (LazyTensors, checkpoint/stream.py).
Every directory is written to a temporary sibling and renamed into place, so a crash never leaves
a half-written OUT and an existing OUT is only replaced (with force) once the new one is complete.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import torch
from safetensors import safe_open

from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint.boxes import Box
from megaframe.checkpoint.sharded import ShardReader
from megaframe.checkpoint.stream import write_streaming
from megaframe.common import json_text
from megaframe.common.atomic_io import fsync_file
from megaframe.common.safe_files import not_a_file
from megaframe.checkpoint.tokenizer_record import RECORD_KEY
from megaframe.common.tokenizer_files import tokenizer_files
from megaframe.convert.hf import ConvertError
from megaframe.data.preprocess_stop import Stopped, signals_deferred
from megaframe.data.temp_files import dead_writers, host_tag

TOKENIZER_DIR = "tokenizer"


# ---- Hugging Face directories ----------------------------------------------------------------

def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a local HF model directory, as a dict."""
    config_file = Path(hf_dir) / "config.json"
    if not config_file.is_file():
        raise ConvertError(f"{hf_dir}: no config.json; pass a directory written by save_pretrained()")
    try:
        config = json_text.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConvertError(f"{config_file}: not valid JSON ({err}); pass a directory written by save_pretrained()") \
            from None
    if not isinstance(config, dict):
        raise ConvertError(f"{config_file}: holds {type(config).__name__}, not a JSON object; pass a directory "
                           f"written by save_pretrained()")
    return config


class LazyTensors(Mapping):
    """Tensors made on demand: names and shapes known up front, each tensor made when asked for and
    not kept (the converter holds one tensor, or the few one output needs, at a time).

    part(name, index) is tensor[index] for a tuple of ints and step-1 slices over the leading
    dimensions (one expert of a stacked (E, ...) tensor, gate or up half of a fused one); a source
    that can read a part alone (safetensors, checkpoint boxes) passes `part` and never makes the whole."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], make: Callable[[str], torch.Tensor],
                 part: Optional[Callable[[str, tuple], torch.Tensor]] = None):
        self.shapes, self._make, self._part = shapes, make, part

    def part(self, name: str, index: tuple) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._part(name, index) if self._part is not None else self._make(name)[index]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def read_hf_weights(hf_dir: Path) -> Mapping[str, torch.Tensor]:
    """Every weight tensor of a local HF model directory: safetensors files are read tensor by tensor
    on demand (their headers give the shapes); .bin files are pickles and load whole."""
    files = _weight_files(Path(hf_dir))
    if any(path.suffix != ".safetensors" for path in files):
        state: dict[str, torch.Tensor] = {}
        for path in files:
            state.update(load_weights_file(path))
        return state
    where, shapes = {}, {}
    for path in files:
        if not path.is_file():
            raise ConvertError(f"{path}: weights file not found")
        try:
            header = universal.safetensors_header(path)
        except universal.CheckpointError as err:
            raise ConvertError(str(err)) from err
        for name, meta in header.items():
            where[name], shapes[name] = path, tuple(meta["shape"])

    def make(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def part(name: str, index: tuple) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt", device="cpu") as f:
            return f.get_slice(name)[index]  # reads only the part's bytes
    return LazyTensors(shapes, make, part)


def _utf8_path(path: Path) -> None:
    """safetensors opens only a path of UTF-8 text; a folder named in another encoding made a good
    file "not a readable safetensors file" (review)."""
    if problem := universal.not_utf8(path, "it"):
        raise ConvertError(f"{universal.quote(str(path), 200)}: {problem}")


def _weight_files(hf_dir: Path) -> list[Path]:
    """The weight files, safetensors first; sharded checkpoints through their index."""
    _utf8_path(hf_dir)
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (hf_dir / single).is_file():
            return [hf_dir / single]
        if (hf_dir / index).is_file():
            try:
                weight_map = json_text.loads((hf_dir / index).read_text(encoding="utf-8"))["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
                raise ConvertError(f"{hf_dir / index}: not a shard index with a weight_map ({type(err).__name__}: "
                                   f"{err}); pass a directory written by save_pretrained()") from None
            if not all(isinstance(shard, str) and "/" not in shard and shard not in ("", ".", "..") for shard in shards):
                raise ConvertError(f"{hf_dir / index}: its weight_map names files outside {hf_dir}; refusing it")
            return [hf_dir / shard for shard in shards]
    raise ConvertError(f"{hf_dir}: no model.safetensors or pytorch_model.bin (nor a sharded index); "
                       "save the model with save_pretrained()")


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one weights file: safetensors, or a torch pickle restricted to plain tensors."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: weights file not found")
    _utf8_path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as error:  # SafetensorError (a truncated or garbage file) is no OSError
            raise ConvertError(f"{path}: not a readable safetensors file ({type(error).__name__}); re-download or "
                               f"re-save it") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as error:
        # torch's own message advises weights_only=False, which runs what a crafted file holds: not relayed
        raise ConvertError(f"{path}: refusing to load: it is not a plain tensor file ({type(error).__name__} "
                           f"reading it with torch.load's tensors-only loader); convert it to safetensors from a "
                           "trusted environment") from None
    if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
        raise ConvertError(f"{path}: expected a dict of tensors, found {type(loaded).__name__}")
    return loaded


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files of `src` (a model or tokenizer directory) into dst/: only those
    (a model directory also holds gigabytes of weights), copied as plain files."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in tokenizer_files(src):
        shutil.copy2(path, dst / path.name)


# ---- atomic directories ----------------------------------------------------------------------

def add_legacy_config_keys(config_file: Path, dtype: str) -> None:
    """The keys transformers 5 no longer writes into config.json but 4.x and older vLLM, SGLang and
    lmdeploy read: a top-level rope_theta (v5 keeps it only in rope_parameters; a 4.x LlamaConfig
    then defaults to 10000, silently wrong for Llama 3's 500000) and torch_dtype (the weights'
    dtype; without it vLLM's dtype=auto guesses). transformers 5 folds both back when it loads."""
    config = json_text.loads(Path(config_file).read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        config.setdefault("rope_theta", theta)
    config["torch_dtype"] = config["dtype"] = dtype  # "dtype": transformers 5's name for it
    Path(config_file).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def refuse_existing(final: Path, force: bool, source: Optional[Path] = None, pruned_source: bool = False) -> None:
    """Refuse to touch an existing output directory unless the user passed --force, and never replace
    one that holds the conversion's own input (--force would delete the run it converts), nor one that
    holds the working directory ('', '.', '..': an unset $OUT in a script; the export ran to the end
    and failed on publishing it with a traceback). pruned_source: the input is a checkpoint, which
    train.keep_checkpoints deletes whole, so an output inside it is refused too."""
    if Path(final).name in ("", ".", "..") or Path(final).resolve() in (Path.cwd(), *Path.cwd().parents):
        raise ConvertError(f"output directory {str(final)!r} is the working directory or above it; name a directory "
                           f"of its own for the output, e.g. hf-export")
    if pruned_source and source is not None and Path(source).resolve() in Path(final).resolve().parents:
        raise ConvertError(f"{final} is inside the input {source} (a checkpoint's folder is deleted whole when "
                           f"train.keep_checkpoints prunes it); choose an output directory outside it")
    if Path(final).is_symlink():  # a dangling one too: the conversion ran, then failed on a temp name
        raise ConvertError(f"{final} is a symbolic link; name a directory of its own for the output (--force would "
                           f"replace the link, not the directory it points to)")
    if not Path(final).exists():
        return
    if not Path(final).is_dir():  # --force replaced a file (a run's config.yaml, checkpoints/latest)
        raise ConvertError(f"{final} is a file, not a directory; name a directory for the output")
    if not force:
        raise ConvertError(f"{final} already exists; choose a new output directory or pass --force to replace it")
    if source is not None and Path(final).resolve() in (Path(source).resolve(), *Path(source).resolve().parents):
        raise ConvertError(f"{final} holds the input {source}: --force would delete it; choose an output directory "
                           f"outside it")


def remove_dead_staging(final: Path) -> list[Path]:
    """Remove the staging folders of OUT that a conversion on this host left when it was killed;
    never a live one's, nor another host's on a shared file system. Returns them."""
    pattern = re.compile(rf"\.tmp-{re.escape(final.name)}-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}")
    removed = []
    for entry in dead_writers(final.parent, pattern):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    if removed:
        print(f"megaframe-convert: removed {', '.join(p.name for p in removed)}, left by a conversion that was killed",
              file=sys.stderr, flush=True)
    return removed


def staging_dir(final: Path, force: bool) -> Path:
    """A fresh temporary sibling of `final` to write into (refusing an existing final without force),
    named after this host and process. The folders a killed conversion of the same OUT left (SIGKILL
    runs no cleanup; each as large as the model) are removed first: this host's, whose process is gone."""
    final = Path(final)
    refuse_existing(final, force)
    remove_dead_staging(final)
    tmp = final.parent / f".tmp-{final.name}-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as err:  # a file where a folder should be, a read-only place: a traceback before
        raise ConvertError(f"{final}: cannot create the output directory ({err.strerror or err}); choose one you "
                           f"can write") from None
    return tmp


def publish(tmp: Path, final: Path) -> Path:
    """Rename the complete `tmp` into `final`; an old `final` is moved aside first and deleted last.
    Every file and folder in tmp is flushed first: transformers' save_pretrained, the generation
    config and the tokenizer's copies are written without fsync, and a crash soon after the rename
    left an export with empty config or tokenizer files, its predecessor already deleted."""
    written = [path for path in sorted(Path(tmp).rglob("*")) if path.is_file() and not path.is_symlink()]
    for path in written:
        fsync_file(path)
    universal.sync_dirs(tmp, [path.relative_to(tmp) for path in written])
    try:
        with signals_deferred():  # a stop between the two renames would leave neither copy under OUT
            return universal.replace_dir(tmp, final)
    except Stopped as stop:  # it came during the renames: OUT is the new output, complete
        stop.written.append(str(final))
        raise


# ---- layout-free megaframe checkpoints (megaframe/checkpoint/universal.py) --------------------

def shape_of(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    return tensors.shapes[name] if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)


HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """'5GB', '500MB', '64KiB' or a number of bytes, as save_pretrained's max_shard_size reads them."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if match is None or match[2].upper() not in units or float(match[1]) <= 0:
        raise ConvertError(f"{flag} {text!r}: not a size; write it as 5GB, 500MB or a number of bytes")
    return int(float(match[1]) * units[match[2].upper()])


def write_hf_weights(out_dir: Path, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                     max_shard_bytes: int) -> int:
    """A transformers model's weight files, one tensor at a time: model.safetensors when the weights
    fit in max_shard_bytes, else model-0000K-of-0000N.safetensors of at most that size each (a
    larger tensor alone in its file) and model.safetensors.index.json naming each tensor's file, as
    save_pretrained shards them: the Hub takes no file over 50 GB, and a 70B model in one fp32 file
    is 280 GB. Returns the number of files."""
    size = lambda name: math.prod(shape_of(tensors, name)) * torch.empty((), dtype=dtype).element_size()  # noqa: E731
    shards: list[list[str]] = [[]]
    filled = 0
    for name in tensors:
        if shards[-1] and filled + size(name) > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size(name)
    produce = lambda name: tensors[name].to(dtype).contiguous()  # noqa: E731
    metadata = {"format": "pt"}
    if len(shards) == 1:
        write_streaming(out_dir / "model.safetensors", [(n, dtype, shape_of(tensors, n)) for n in shards[0]],
                        produce, metadata)
        return 1
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_streaming(out_dir / filename, [(n, dtype, shape_of(tensors, n)) for n in shard], produce, metadata)
        weight_map.update({name: filename for name in shard})
    index = {"metadata": {"total_size": sum(size(name) for name in tensors)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(shards)


CONVERTED_FILE_BYTES = 2 * 2**30  # fp32 bytes per shard file of a converted checkpoint (a larger tensor: its own)


def write_sharded_model(directory: Path, model: Mapping[str, torch.Tensor]) -> dict[str, dict]:
    """The tensors as a trained checkpoint stores them (shards/ files, index.json), whole, in files
    of at most CONVERTED_FILE_BYTES each: a resume's verification splits the files over the ranks by bytes
    (common/file_hash.py), and one model.safetensors (276 GB at 70B in fp32) was hashed by one
    rank while the others waited. Returns {file: {bytes, sha256}}, hashed as written."""
    files: list[list[str]] = [[]]
    filled = 0
    for name in model:
        size = 4 * math.prod(shape_of(model, name))
        if files[-1] and filled + size > CONVERTED_FILE_BYTES:
            files.append([])
            filled = 0
        files[-1].append(name)
        filled += size
    for number, names in enumerate(files):
        shapes = {name: tuple(shape_of(model, name)) for name in names}
        pieces = [sharded.Piece(name, shape, Box((0,) * len(shape), shape), lambda name=name: model[name])
                  for name, shape in shapes.items()]
        sharded.write_record(directory, sharded.write_rank_shard(directory, number, pieces))
    return sharded.merge_records(directory, len(files))


def write_layout_free(out: Path, model: Mapping[str, torch.Tensor], state: dict, tokenizer_src: Optional[Path] = None,
                      force: bool = False) -> Path:
    """Write a model-only layout-free checkpoint (fp32 canonical tensors, state.json, manifest.json
    last, tokenizer/ when given) to `out`, atomically, one tensor at a time. Only the tokenizer's own
    files are copied (an HF model directory also holds gigabytes of weights)."""
    out = Path(out)
    tmp = staging_dir(out, force)
    try:
        if tokenizer_src is not None:
            copy_tokenizer(tokenizer_src, tmp / TOKENIZER_DIR)
            state = {**state, "tokenizer": str((out / TOKENIZER_DIR).resolve())}
            if RECORD_KEY in state:  # the copy is what the checkpoint names from now on
                state[RECORD_KEY] = {**state[RECORD_KEY], "name": state["tokenizer"]}
        hashed = write_sharded_model(tmp, model)
        universal.write_state(tmp, {**state, "version": universal.SHARDED_VERSION})
        universal.write_manifest(tmp, hashed)
        return publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_checkpoint(path: Path) -> Path:
    """A layout-free checkpoint directory, or a run's checkpoints/ directory through its `latest`."""
    path = Path(path)
    try:  # the same rule as the trainer's: `latest` names a checkpoint of that directory, nothing else
        path = universal.latest_pointer(path) or path
    except universal.CheckpointError as err:
        raise ConvertError(str(err)) from None
    if not universal.has_universal(path):
        kind = universal.misnamed_checkpoint(path)
        if kind == "missing":
            raise ConvertError(f"{path}: no such directory; pass a checkpoint (RUN/checkpoints/global_stepN) or a "
                               f"run's checkpoints/ directory")
        if kind == "run":
            raise ConvertError(f"{path}: a run directory, not a checkpoint; pass its checkpoints, "
                               f"{path / 'checkpoints'} (the newest), or one of them such as "
                               f"{path / 'checkpoints' / 'global_stepN'}")
        if kind == "hf":
            raise ConvertError(f"{path}: a Hugging Face model, not a megaframe checkpoint; import it first with "
                               f"megaframe-convert from-hf {path} OUT and pass OUT")
        if kind == "unsaved":
            raise ConvertError(f"{path}: no checkpoint in it yet (no `{universal.LATEST_FILE}`: the run has not "
                               f"finished a save); train.save_interval sets how often a run saves")
        for name in (universal.STATE_FILE, universal.INDEX_FILE, universal.MODEL_FILE):
            if problem := not_a_file(path / name):  # a FIFO of its name: "needs state.json" (review)
                raise ConvertError(f"{problem}; the checkpoint was changed since it was saved")
        raise ConvertError(f"{path}: not a layout-free megaframe checkpoint (needs {universal.STATE_FILE} and "
                           f"{universal.INDEX_FILE} or {universal.MODEL_FILE}); pass a checkpoint directory or a "
                           f"run's checkpoints/ directory")
    return path


def open_layout_free(path: Path) -> tuple[dict, ShardReader]:
    """(state.json, a reader of its tensors) of a verified layout-free checkpoint of either version;
    the reader is a context manager."""
    path = resolve_checkpoint(path)
    try:
        sharded.verify_for_weights(path)  # its weights are what it reads
        return universal.read_state(path), ShardReader(path)
    except universal.CheckpointError as err:
        raise ConvertError(str(err)) from err


def model_tensors(reader: ShardReader) -> LazyTensors:
    """The weights (not the optimizer state) of a checkpoint, each read when asked for; the
    reader's memory maps are released after each, so one tensor is resident at a time."""
    def make(name: str) -> torch.Tensor:
        try:
            return reader.full(name)
        except universal.CheckpointError as err:  # read lazily, mid-export: a chunk missing, a shard damaged
            raise ConvertError(str(err)) from None
        finally:
            reader.release()

    def part(name: str, index: tuple) -> torch.Tensor:  # one box of the stored chunks (one expert)
        shape = reader.shape(name)
        offset, size, keep = [], [], []
        for dim, n in enumerate(shape):
            where = index[dim] if dim < len(index) else slice(None)
            if isinstance(where, int):
                offset.append(where % n)
                size.append(1)
                continue
            start, stop, step = where.indices(n)
            if step != 1:
                raise ValueError(f"{name}: part reads take step-1 slices, got {where}")
            offset.append(start)
            size.append(max(0, stop - start))
            keep.append(dim)
        try:
            value = reader.read(name, Box(tuple(offset), tuple(size)))
        except universal.CheckpointError as err:
            raise ConvertError(str(err)) from None
        finally:
            reader.release()
        return value.reshape([size[d] for d in keep])
    return LazyTensors({k: reader.shape(k) for k in reader.keys() if not universal.is_optimizer_key(k)}, make, part)


def read_layout_free(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(state.json, canonical fp32 model tensors) of a verified layout-free checkpoint."""
    path = resolve_checkpoint(path)
    try:
        state, model, _ = sharded.read_universal(path, optimizer_state=False)
    except universal.CheckpointError as err:
        raise ConvertError(str(err)) from err
    return state, model
