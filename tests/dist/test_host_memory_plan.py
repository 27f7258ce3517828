"""The planner's host-memory figure for a background save (plan/host.py) against what the ranks copy.

Each layout trains two steps with train.async_save=true on real gloo ranks and saves after the
second; every rank reports the bytes its save copied into host memory (checkpoint/staging.py:
HostStaging.staged_bytes, counted as the copies are made). The planner's "async copies" per rank is
the largest of them within 2%: its count of a rank's parameters keeps the replicated norms on every
TP rank (only TP rank 0 writes them) and the vocabulary padding (never written); the model's
vocabulary here needs none. The planner never reads a run: its figure comes from the config alone."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import TINY
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow

SAVE = ["train.max_steps=2", "train.save_interval=2", "train.async_save=true", "train.eval_interval=0",
        "model.vocab_size=512"]
LAYOUTS = {  # name: (world size, overrides)
    "deepspeed-dp2-zero1-bf16": (2, ["parallel.dp=2", "zero=stage1", "precision=bf16"]),
    "deepspeed-dp2-zero3-fp32": (2, ["parallel.dp=2", "zero=stage3"]),
    "deepspeed-tp2-zero1-bf16": (2, ["parallel.tp=2", "zero=stage1", "precision=bf16"]),
    "fsdp2-dp2-bf16": (2, ["backend=fsdp2", "parallel.dp=2", "zero=stage3", "precision=bf16"]),
    "deepspeed-dp2-zero1-muon": (2, ["parallel.dp=2", "zero=stage1", "optim=muon"]),
}


def _staged(rank: int, world: int, overrides: list[str], run_dir: str) -> int:
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.training.trainer import Trainer

    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    with trainer:
        trainer.fit()
    return trainer.checkpoints.staging.staged_bytes


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_planners_async_copies_are_what_the_ranks_copy(name, tmp_path):
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.plan.estimate import estimate_config

    world, layout = LAYOUTS[name]
    overrides = [*TINY, *SAVE, *layout, f"hydra.run.dir={tmp_path / 'run'}"]
    staged = run_ranks(_staged, world, tmp_path, overrides=overrides, run_dir=str(tmp_path / "run"))
    cfg, _ = compose(overrides)
    est = estimate_config(cfg, validate_for_engine(cfg, world, ask_bf16=False))
    planned = est.host
    assert planned is not None and planned.ranks == world
    assert min(staged) > 0, staged
    assert planned.async_copies == pytest.approx(max(staged), rel=0.02), (planned, staged)
    # the fast tier's part is the rank's files as written (weights widened to fp32): the same
    # count, against the saved shard files' sizes (their safetensors headers besides)
    shards = tmp_path / "run" / "checkpoints" / "global_step2" / "shards"
    written = [sum(f.stat().st_size for f in shards.glob(f"rank{rank:05d}*.safetensors")) for rank in range(world)]
    assert max(s.checkpoint_file for s in est.stages) == pytest.approx(max(written), rel=0.03), written
    # the same model without the background save keeps nothing of it in host memory
    cfg, _ = compose([*overrides, "train.async_save=false"])
    assert estimate_config(cfg, validate_for_engine(cfg, world, ask_bf16=False)).host.async_copies == 0
