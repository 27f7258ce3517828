"""Read an offline W&B run (run-ID.wandb) back without the network or the wandb service.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
records, each a 7-byte header (crc32c, length, type) and a piece of a serialized protobuf Record.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing ':W&B' header)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # the writer pads the tail of a block
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        piece = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield piece
        elif kind == _FIRST:
            pending = piece
        elif kind == _MIDDLE:
            pending += piece
        elif kind == _LAST:
            yield pending + piece
            pending = b""
        elif kind == 0 and length == 0:
            break  # zero padding at the end of a file still being written


def read_offline_run(run_file: Path) -> dict[str, Any]:
    """{'config': {key: value}, 'history': [{key: value}, ...], 'id', 'name', 'group'} from a run-ID.wandb file."""
    from wandb.proto import wandb_internal_pb2

    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    run_info: dict[str, str] = {}
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        # the config given to wandb.init travels in the run record; later updates as config records
        if kind == "run":
            run_info = {"id": record.run.run_id, "name": record.run.display_name, "group": record.run.run_group}
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else ()
        for item in updates:
            config[item.key] = json.loads(item.value_json)
        if kind == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append(row)
    return {"config": config, "history": history, **run_info}
