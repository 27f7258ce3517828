"""Reading and writing the converter's directories, never unpickling arbitrary objects.

- Hugging Face model directories: config.json plus safetensors (or, refusing anything but plain
  tensors, torch.load(weights_only=True) for pytorch_model*.bin), single-file or sharded.
- Layout-free megaframe checkpoints (shared format, see the checkpoint format contract):
  model.safetensors + state.json + manifest.json (+ tokenizer/). This is a small private
  writer/reader until megaframe/checkpoint/universal.py takes over.
Every directory is written to a temporary sibling and renamed into place, so a crash never leaves
a half-written OUT and an existing OUT is only replaced (with force) once the new one is complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Optional

import torch

from megaframe.convert.hf import ConvertError

FORMAT = "megaframe-universal"
FORMAT_VERSION = 1
MODEL_FILE, STATE_FILE, MANIFEST_FILE, TOKENIZER_DIR = "model.safetensors", "state.json", "manifest.json", "tokenizer"
LATEST = "latest"
# what save_pretrained() writes for a tokenizer (any of these marks a directory as holding one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")


# ---- Hugging Face directories ----------------------------------------------------------------

def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a local HF model directory, as a dict."""
    config_file = Path(hf_dir) / "config.json"
    if not config_file.is_file():
        raise ConvertError(f"{hf_dir}: no config.json; pass a directory written by save_pretrained()")
    return json.loads(config_file.read_text())


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight tensor of a local HF model directory."""
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(hf_dir)):
        state.update(load_weights_file(path))
    return state


def _weight_files(hf_dir: Path) -> list[Path]:
    """The weight files, safetensors first; sharded checkpoints through their index."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (hf_dir / single).is_file():
            return [hf_dir / single]
        if (hf_dir / index).is_file():
            shards = sorted(set(json.loads((hf_dir / index).read_text())["weight_map"].values()))
            return [hf_dir / shard for shard in shards]
    raise ConvertError(f"{hf_dir}: no model.safetensors or pytorch_model.bin (nor a sharded index); "
                       "save the model with save_pretrained()")


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one weights file: safetensors, or a torch pickle restricted to plain tensors."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: weights file not found")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as error:
        reason = " ".join(str(error).split())[:200]
        raise ConvertError(f"{path}: refusing to load: it is not a plain tensor file (torch.load with "
                           f"weights_only=True failed: {reason}); convert it to safetensors from a trusted "
                           "environment") from None
    if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
        raise ConvertError(f"{path}: expected a dict of tensors, found {type(loaded).__name__}")
    return loaded


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` holds a saved HF tokenizer."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files of `src` (a model or tokenizer directory) into dst/."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)


# ---- atomic directories ----------------------------------------------------------------------

def refuse_existing(final: Path, force: bool) -> None:
    """Refuse to touch an existing output directory unless the user passed --force."""
    if Path(final).exists() and not force:
        raise ConvertError(f"{final} already exists; choose a new output directory or pass --force to replace it")


def staging_dir(final: Path, force: bool) -> Path:
    """A fresh temporary sibling of `final` to write into (refusing an existing final without force)."""
    final = Path(final)
    refuse_existing(final, force)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, final: Path) -> Path:
    """Rename the complete `tmp` into `final`; an old `final` is moved aside first and deleted last."""
    final = Path(final)
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)
    return final


# ---- layout-free megaframe checkpoints -------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_layout_free(out: Path, model: dict[str, torch.Tensor], state: dict, tokenizer_src: Optional[Path] = None,
                      force: bool = False) -> Path:
    """Write a model-only layout-free checkpoint (fp32 canonical tensors, state.json, manifest.json
    last, tokenizer/ when given) to `out`, atomically."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = staging_dir(out, force)
    try:
        tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in model.items()}
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        state = {"format": FORMAT, "version": FORMAT_VERSION, **state}
        if tokenizer_src is not None:
            copy_tokenizer(tokenizer_src, tmp / TOKENIZER_DIR)
            state["tokenizer"] = str((out / TOKENIZER_DIR).resolve())
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
            "tensors": {MODEL_FILE: {name: {"shape": list(t.shape), "dtype": "F32"} for name, t in tensors.items()}},
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        return publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_checkpoint(path: Path) -> Path:
    """A layout-free checkpoint directory, or a run's checkpoints/ directory through its `latest`."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not (path / STATE_FILE).is_file() or not (path / MODEL_FILE).is_file():
        raise ConvertError(f"{path}: not a layout-free megaframe checkpoint (needs {MODEL_FILE} and {STATE_FILE}); "
                           "pass a checkpoint directory or a run's checkpoints/ directory")
    return path


def verify_manifest(path: Path) -> None:
    """Check size and sha256 of every file manifest.json lists; refuse the first bad one."""
    manifest_file = path / MANIFEST_FILE
    if not manifest_file.is_file():
        raise ConvertError(f"{path}: no {MANIFEST_FILE}; the checkpoint is incomplete (a save that did not finish?)")
    for name, meta in json.loads(manifest_file.read_text())["files"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != meta["bytes"] or _sha256(file) != meta["sha256"]:
            raise ConvertError(f"{path}: {name} is missing or does not match manifest.json (corrupt or truncated)")


def read_layout_free(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(state.json, canonical fp32 tensors) of a verified layout-free checkpoint."""
    from safetensors.torch import load_file

    path = resolve_checkpoint(path)
    verify_manifest(path)
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise ConvertError(f"{path}: {STATE_FILE} format={state.get('format')!r}, expected {FORMAT!r}")
    return state, load_file(str(path / MODEL_FILE))
