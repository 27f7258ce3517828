"""metrics.jsonl: one JSON object per logged step, kept as one continuous record across resumes."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from megaframe.common import json_text
from megaframe.common.atomic_io import atomic_write_text
from megaframe.common.safe_files import open_regular


class MetricsLog:
    """Appends records to RUN_DIR/metrics.jsonl (call from the one rank that logs)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def truncate_after(self, step: int) -> int:
        """Drop records of steps after `step` (logged past the checkpoint we resume from).

        Returns how many records were dropped. The rewrite is atomic: a crash keeps the old file.
        """
        if not os.path.lexists(self.path):
            return 0
        kept, dropped = [], 0
        with os.fdopen(open_regular(self.path, os.O_RDONLY)) as f:  # a planted link (to /dev/zero) is refused
            text = f.read()
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                record = json_text.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash mid-write
                dropped += 1
                continue
            if record.get("step", 0) > step:
                dropped += 1
            else:
                kept.append(line)
        if dropped:
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        return dropped

    def sync(self) -> None:
        """fsync the records written so far: a checkpoint is published after its steps' records are
        on disk, so a node that crashes after the publish leaves no gap before the step resumed from."""
        try:
            fd = open_regular(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return  # nothing logged yet
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def append(self, record: dict[str, Any]) -> None:
        """Add one record and flush it to disk: strict JSON, a non-finite number written as null
        (Python's NaN and Infinity are no JSON; jq and browsers refuse the line)."""
        # not through a link planted in the run dir: appending would write into its target
        with os.fdopen(open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
            f.write(json.dumps(strict_json(record), sort_keys=False, allow_nan=False) + "\n")
            f.flush()


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float, at any depth, replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json_text.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def memory_gb() -> float:
    """This rank's memory: peak CUDA allocation on a GPU, resident set size on CPU (GiB)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil  # a dependency of deepspeed

    return psutil.Process().memory_info().rss / 2**30


def run_metadata(world_size: int, layout: dict[str, int], engine_versions: dict[str, str],
                 engine: str = "") -> dict[str, Any]:
    """What a tracked run should say about where it ran: layout, the engine that stepped it (plain:
    a one-process run without DeepSpeed, backends/plain/), versions (the engine's from its backend),
    git commit."""
    import platform
    import subprocess

    import torch

    import megaframe

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(megaframe.__file__).parent, text=True,
                                capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None  # installed from a wheel, or no git
    return {"world_size": world_size, "layout": layout, "engine": engine, "git_commit": commit,
            "versions": {"megaframe": megaframe.__version__, "torch": torch.__version__,
                         **engine_versions, "python": platform.python_version()}}
