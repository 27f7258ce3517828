"""Write a safetensors file one tensor at a time, hashing the bytes as they go out.

safetensors.torch.save_file needs every tensor in one dict and builds the whole file in memory
first; a rank saving its shard, or the converter writing a 70B model, should hold one tensor at a
time. The header (names, dtypes, shapes, byte offsets) is known before any data, so it is written
first and each tensor's bytes follow in header order. The files are ordinary safetensors: safe_open
and load_file read them.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from math import prod
from pathlib import Path
from typing import Callable, Iterable

import torch

from megaframe.common.safe_files import create_fresh

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is a contiguous CPU tensor (one copy from a device)."""
    tensor = tensor.detach().contiguous().cpu()
    # numpy has no bfloat16: reinterpret as an integer of the same width (the bytes are what matter)
    return memoryview(tensor.view(_SAME_WIDTH_INT[tensor.element_size()]).numpy()).cast("B")


def write_streaming(path: Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                    produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write `path` (atomically: a temporary sibling renamed at the end) holding one tensor per
    entry (name, dtype, shape), each made by produce(name) when its turn comes and dropped after.
    Returns (bytes written, sha256 of the file)."""
    entries = list(entries)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        size = prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    digest = hashlib.sha256()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with os.fdopen(create_fresh(tmp), "wb") as f:  # a link planted at the temp name is not followed
            for piece in (struct.pack("<Q", len(blob)), blob):
                f.write(piece)
                digest.update(piece)
            for name, dtype, shape in entries:
                tensor = produce(name)
                if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise ValueError(f"{name}: produced {tensor.dtype} {list(tensor.shape)}, the header says "
                                     f"{dtype} {list(shape)}")
                data = _as_bytes(tensor)
                f.write(data)
                digest.update(data)
                del tensor, data
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return 8 + len(blob) + offset, digest.hexdigest()
