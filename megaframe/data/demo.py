"""A byte-tokenized demo corpus built on first use from the Python standard library's own source files."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from megaframe.data.indexed import DataError, IndexedDatasetWriter, best_dtype, umask_permissions
from megaframe.data.tokenizer import ByteTokenizer

__all__ = ["DEMO_PREFIX_NAME", "demo_cache_key", "ensure_demo_dataset"]

DEMO_PREFIX_NAME = "demo"


def demo_cache_key(max_bytes: int) -> str:
    """Directory name of the cached demo dataset; differs per Python build, since its stdlib text differs."""
    return f"stdlib-{sys.implementation.name}{platform.python_version()}-{max_bytes}b-v1"


def _stdlib_sources() -> list[Path]:
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    return sorted((path for path in stdlib_dir.glob("*.py") if path.is_file()), key=lambda path: path.name)


def _build(prefix: Path, max_bytes: int) -> None:
    tokenizer = ByteTokenizer()
    sources = _stdlib_sources()
    if not sources:
        raise DataError(
            f"demo dataset: no *.py files in {sysconfig.get_paths()['stdlib']}; "
            "set data.path to a dataset built with megaframe-preprocess"
        )
    collected_bytes = 0
    used_files = []
    with IndexedDatasetWriter(prefix, dtype=best_dtype(tokenizer.vocab_size)) as writer:
        for source in sources:
            if collected_bytes >= max_bytes:
                break
            # Raw file bytes are exactly what ByteTokenizer.encode yields for UTF-8 text, minus the decode.
            raw = source.read_bytes()
            tokens = np.empty(len(raw) + 1, dtype=np.uint16)
            tokens[:-1] = np.frombuffer(raw, dtype=np.uint8)
            tokens[-1] = tokenizer.eod_id
            writer.add_document(tokens)
            collected_bytes += len(raw)
            used_files.append(source.name)
        # Only build-independent facts go in: two builds on one Python must be byte-identical.
        writer.finalize(
            {
                "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size,
                "eod_id": tokenizer.eod_id,
                "source": "python-stdlib",
                "python_version": platform.python_version(),
                "max_bytes": max_bytes,
                "source_files": used_files,
            }
        )


DEMO_BYTES = 2_000_000  # the built-in corpus's size, in bytes of stdlib text


def demo_built(cache_dir: Path, max_bytes: int = DEMO_BYTES) -> bool:
    """Whether the built-in corpus is in `cache_dir` already (a cache that is then only read)."""
    return (Path(cache_dir) / demo_cache_key(max_bytes)).is_dir()


def ensure_demo_dataset(cache_dir: Path, max_bytes: int = DEMO_BYTES) -> Path:
    """Prefix of the demo dataset under `cache_dir`, building it (about max_bytes of stdlib text) if absent."""
    if max_bytes < 1:
        raise DataError(f"max_bytes={max_bytes}: the demo corpus needs at least 1 byte")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final_dir = cache_dir / demo_cache_key(max_bytes)
    # The directory only ever appears through an atomic rename of a finished build, so existing means complete.
    if demo_built(cache_dir, max_bytes):
        return final_dir / DEMO_PREFIX_NAME
    build_dir = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{final_dir.name}.building-"))
    try:
        _build(build_dir / DEMO_PREFIX_NAME, max_bytes)
        os.chmod(build_dir, umask_permissions(0o777))
        try:
            os.rename(build_dir, final_dir)
        except OSError:
            # Another process finished first: its copy is identical, so keep it and drop ours.
            if not final_dir.is_dir():
                raise
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return final_dir / DEMO_PREFIX_NAME
