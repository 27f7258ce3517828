"""Atomic checkpoints through the DeepSpeed engine.

Layout under RUN_DIR/checkpoints/:
  global_step{N}/      DeepSpeed's files for step N plus rng_rank{R}.pt for every rank
  latest               the name of the newest complete checkpoint, replaced atomically and last
A save goes to tmp-global_step{N}/ first and is renamed once every rank has written its part, so a
crash mid-save leaves `latest` pointing at the previous, complete checkpoint.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megaframe.tracking.metrics import atomic_write_text

LATEST = "latest"
TMP_PREFIX = "tmp-"


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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(engine, save_dir: Path, step: int, client_state: dict[str, Any],
         rng_state: Optional[dict[str, Any]] = None) -> Path:
    """Save every rank's shard, then (rank 0) publish it: rename into place, update `latest`."""
    save_dir = Path(save_dir)
    tag = tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    if _rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(save_dir / tmp_tag, ignore_errors=True)  # debris of a save that crashed
    _barrier()
    engine.save_checkpoint(str(save_dir), tag=tmp_tag, client_state=client_state, save_latest=False)
    torch.save({"cpu": torch.get_rng_state(), **(rng_state or {})}, save_dir / tmp_tag / f"rng_rank{_rank()}.pt")
    _barrier()
    final = save_dir / tag
    if _rank() == 0:
        if final.exists():  # re-saving a step (e.g. after a resume): keep the old one until the swap
            old = save_dir / (TMP_PREFIX + "old-" + tag)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(save_dir / tmp_tag, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(save_dir / tmp_tag, final)
        atomic_write_text(save_dir / LATEST, tag + "\n")
    _barrier()
    return final


def find_latest(save_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint under save_dir, or None."""
    pointer = Path(save_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(save_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def resolve_resume(resume: str, run_checkpoints: Path) -> Optional[Path]:
    """Map train.resume (auto | none | a path) to a checkpoint directory, or None for a fresh start."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(run_checkpoints)
    path = Path(resume)
    latest = find_latest(path)  # a checkpoints/ directory with a `latest` pointer
    return latest if latest is not None else path


def load(engine, path: Path) -> ResumePoint:
    """Load model, optimizer, scheduler and this rank's RNG from a checkpoint directory.

    The returned rng_state holds what the caller passed to save() besides the CPU generator."""
    path = Path(path)
    loaded, client_state = engine.load_checkpoint(str(path.parent), tag=path.name)
    if loaded is None:
        raise RuntimeError(f"train.resume: DeepSpeed could not load a checkpoint from {path}")
    rng_file = path / f"rng_rank{_rank()}.pt"
    rng_state = torch.load(rng_file, weights_only=True) if rng_file.exists() else {}
    if "cpu" in rng_state:
        torch.set_rng_state(rng_state["cpu"])
    return ResumePoint(path=path, step=int(client_state["step"]), client_state=client_state, rng_state=rng_state)
