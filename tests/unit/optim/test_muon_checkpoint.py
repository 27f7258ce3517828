"""A Muon run's checkpoint at one rank: its state stored by name in the layout-free format
(momentum_buffer.NAME for Muon's matrices, AdamW's moments for the rest, state.json's optimizer
record); a resume continues the uninterrupted run bit for bit; another optimizer on resume is refused
in one line unless accepted, and then starts from the checkpoint's weights. FSDP2 on one rank steps
the same Muon. One forked rank trains the four runs (one process start)."""
from __future__ import annotations

import pytest

from megaframe.checkpoint import sharded, universal
from megaframe.checkpoint.optimizer_check import OptimizerRecord
from megaframe.checkpoint.universal import CheckpointError
from tests.support.helpers import TINY, curve, read_metrics
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks

BASE = [*TINY, "train.max_steps=6", "optim.warmup_steps=2"]
MUON = [*BASE, "optim=muon"]


def test_a_muon_checkpoint_resumes_and_refuses_another_optimizer(tmp_path, capsys):
    saved = tmp_path / "first" / "checkpoints" / "global_step3"
    runs = [([*MUON, "train.save_interval=3"], tmp_path / "first"),
            ([*MUON, f"train.resume={saved}"], tmp_path / "resumed"),
            ([*BASE, "train.resume_accept_optimizer_change=true", f"train.resume={saved}"],
             tmp_path / "switched"),
            ([*MUON, "backend=fsdp2"], tmp_path / "fsdp2")]
    run_ranks(train_runs, 1, tmp_path, runs=[(overrides, str(run_dir)) for overrides, run_dir in runs])
    first, resumed, switched, fsdp2 = (curve(read_metrics(run_dir), "loss") for _, run_dir in runs)

    assert [s for s, _ in first] == list(range(1, 7)) and resumed == first[3:]  # bit for bit after the resume
    # the switch resumed step 3's weights (step 4's loss is theirs, before any update), then AdamW stepped
    assert switched[0] == first[3] and switched[1] != first[4]
    for (step, a), (_, b) in zip(fsdp2, first):
        assert a == pytest.approx(b, rel=1e-4), f"fsdp2 at step {step}: {a} vs the plain engine's {b}"

    assert universal.read_state(saved)["optimizer_record"] == {"name": "muon"}
    with sharded.ShardReader(saved) as reader:
        keys = set(reader.keys())
    assert {"momentum_buffer.blocks.0.attn.q_proj.weight", "momentum_buffer.blocks.1.mlp.down_proj.weight",
            "exp_avg.embed.tok.weight", "exp_avg_sq.blocks.0.attn_norm.weight"} <= keys
    assert not any(k.startswith("exp_avg") and k.endswith("_proj.weight") for k in keys)

    with pytest.raises(CheckpointError, match=r"was trained with optim=muon, this run asks for optim=adamw.*"
                                              r"train.resume_accept_optimizer_change=true$"):
        OptimizerRecord("adamw", accept=False).precheck(saved, announce=True)
    OptimizerRecord("adamw", accept=True).precheck(saved, announce=True)
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert "optim=adamw starts its state fresh from the checkpoint's weights" in warning
