"""Checkpoints at scale: each rank writes what it owns and reads what it needs, nothing more.

A 22M-parameter model (7 layers, hidden 512) trains one step and saves, then loads that checkpoint, at dp=1, 2, 4 with
ZeRO-1, dp=1, 2, 4 with ZeRO-3 and tp2 x pp2 x dp2 (real gloo ranks). On every rank:
- the resident memory the save and the load add at their peak (the kernel's high-water mark) is
  at most the rank's own part of the checkpoint plus the largest tensor plus 10%;
- no collective during save or load moves more than 1% of the model's state (the old format
  gathered all of it on rank 0), but for ZeRO-1's load, which all-gathers the weights once from the
  masters' ranges, as each of its steps does;
- each rank reads from the checkpoint only the range of each tensor it owns (its ZeRO partition):
  under ZeRO-1 every replica read its whole TP shard of the weights before;
- the bytes written per rank fall about as 1/dp.
The values themselves are checked by the resharding matrix (test_reshard.py)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow

MODEL = ["model.num_layers=7", "model.hidden_size=512", "model.num_attention_heads=8", "model.ffn_hidden_size=2048",
         "model.seq_length=32", "parallel.micro_batch_size=1", "train.max_steps=1", "train.log_interval=1",
         "train.eval_interval=0", "train.save_interval=0", "logging.wandb.mode=disabled",
         "logging.progress_bar=false"]
LAYOUTS = {  # name: (world size, overrides)
    "dp1-zero1": (1, ["zero=stage1"]),
    "dp2-zero1": (2, ["zero=stage1"]),
    "dp4-zero1": (4, ["zero=stage1"]),
    "dp1-zero3": (1, ["zero=stage3"]),
    "dp2-zero3": (2, ["zero=stage3"]),
    "dp4-zero3": (4, ["zero=stage3"]),
    "tp2pp2dp2-zero1": (8, ["parallel.tp=2", "parallel.pp=2", "zero=stage1"]),
}


def _save_and_load(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    from tests.support.memory_probe import collective_bytes, fixed_mmap_threshold, peak_rss

    from megaframe.backends.deepspeed import state_io
    from megaframe.checkpoint import sharded
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.checkpoint import store as checkpoint
    from megaframe.training.trainer import Trainer
    from megaframe.model.spec import ModelSpec

    fixed_mmap_threshold()
    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    measured = {}
    save = trainer.checkpoints.save

    def measured_save(step):
        with peak_rss() as peak, collective_bytes() as calls:
            save(step)
        measured.update(save_extra=peak["extra"], save_calls=calls)
    trainer.checkpoints.save = measured_save
    with trainer:
        trainer.fit()
        path = trainer.last_checkpoint
        read_from_files, reader_read = [0], sharded.ShardReader.read

        def counted_read(self, key, box, out=None):
            read_from_files[0] += 4 * math.prod(box.shape)
            return reader_read(self, key, box, out)
        sharded.ShardReader.read = counted_read
        try:
            with peak_rss() as peak, collective_bytes() as calls:
                checkpoint.load_any(trainer.backend, path)
        finally:
            sharded.ShardReader.read = reader_read
        measured.update(load_extra=peak["extra"], load_calls=calls, read_from_files=read_from_files[0])
        view = trainer.backend._view()
        keys = len(state_io._stored_keys(view, with_optimizer=True))
        # what this rank may read: each stored tensor's range it owns (its ZeRO partition)
        read = sum(4 * (h.own[1] - h.own[0]) * keys for h in state_io.holdings(view))
        weights = sum(4 * h.numel for h in state_io.holdings(view))  # this rank's TP x PP shard of the weights
    spec = ModelSpec(trainer.dims)
    shards = [Path(path) / sharded.shard_file(rank, optimizer) for optimizer in (False, True)]
    return {**measured, "shard_bytes": sum(s.stat().st_size for s in shards if s.exists()), "read_bytes": read,
            "weight_bytes": weights,
            "largest_tensor": 4 * max(math.prod(p.shape) for p in spec.parameters.values()),
            "model_params": sum(math.prod(p.shape) for p in spec.parameters.values()), "state_keys": keys}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_writes_and_reads_only_its_own_state(layout, tmp_path):
    world, extra = LAYOUTS[layout]
    results = run_ranks(_save_and_load, world, tmp_path,
                        overrides=[*MODEL, f"parallel.global_batch_size={world}", *extra], run_dir=str(tmp_path / "run"))
    params = results[0]["model_params"]
    assert params >= 20e6, params
    state_bytes = 4 * params * results[0]["state_keys"]
    rows = []
    for rank, r in enumerate(results):
        slack = 0.10
        # ZeRO-1 gathers the weights once from the masters' ranges (the all-gather's input and output: at most
        # twice the rank's shard of the weights moved; gloo's buffers for it at most that shard once)
        gathered = r["weight_bytes"] if "zero1" in layout and world > 1 else 0
        save_bound = (r["shard_bytes"] + r["largest_tensor"]) * (1 + slack)
        load_bound = (r["read_bytes"] + r["largest_tensor"] + gathered) * (1 + slack)
        assert r["save_extra"] <= save_bound, (layout, rank, r["save_extra"], save_bound)
        assert r["load_extra"] <= load_bound, (layout, rank, r["load_extra"], load_bound)
        assert r["read_from_files"] <= r["read_bytes"], (layout, rank, r["read_from_files"], r["read_bytes"])
        assert max(r["save_calls"], default=0) <= 0.01 * state_bytes, (layout, rank, max(r["save_calls"]), state_bytes)
        assert sum(r["load_calls"]) <= 2 * gathered + 0.01 * state_bytes, (layout, rank, r["load_calls"], gathered)
        rows.append({"rank": rank, "written": r["shard_bytes"], "save_peak_extra": r["save_extra"],
                     "load_peak_extra": r["load_extra"], "read": r["read_from_files"],
                     "load_collectives": sum(r["load_calls"])})
    written = sum(r["shard_bytes"] for r in results)
    assert written >= state_bytes  # the whole state is in the checkpoint, once (+ headers)
    assert written <= state_bytes * 1.01
    if layout.startswith("dp") and world > 1:  # ZeRO spreads the writing evenly over the DP ranks
        assert max(r["shard_bytes"] for r in results) <= 1.1 * written / world
    if out := os.environ.get("MEGAFRAME_MEMORY_TABLE"):
        with open(out, "a") as f:
            f.write(json.dumps({"layout": layout, "params": params, "state_bytes": state_bytes, "ranks": rows}) + "\n")


def _gather_everything(rank: int, world: int) -> dict:
    """What the old format did: every rank's state pickled to rank 0 (here 64 MB from each)."""
    import torch
    import torch.distributed as dist
    from tests.support.memory_probe import collective_bytes, peak_rss

    state = {"w": torch.full((16 * 2**20,), float(rank))}
    with peak_rss() as peak, collective_bytes() as calls:
        pieces = [None] * world if rank == 0 else None
        dist.gather_object(state, pieces, dst=0)
        if rank == 0:
            assert all(p["w"][0].item() == r for r, p in enumerate(pieces))
        del pieces
    return {"extra": peak["extra"], "largest_call": max(calls)}


def test_the_probes_see_a_whole_state_gather(tmp_path):
    """The two probes above catch the pattern they guard against: rank 0 receiving every rank's state."""
    results = run_ranks(_gather_everything, 2, tmp_path)
    state = 64 * 2**20
    assert results[0]["extra"] >= 2 * state  # its own pickle and the one it received, at least
    assert results[0]["largest_call"] >= state and results[1]["largest_call"] >= state
