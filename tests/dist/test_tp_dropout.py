"""Dropout under TP: the same stream on every TP rank outside TP regions, a per-rank stream inside
them; reproducible for a fixed layout; activation checkpointing redraws the same masks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.model.gpt import Dropout
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from tests.support.ranks import run_ranks

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, ffn_hidden_size=128,
                  dropout=0.3)


def _streams(rank: int, world: int) -> dict:
    ps = ParallelState.build(ParallelDims(tp=world))
    torch.manual_seed(5)  # the trainer seeds the default stream identically on every rank
    model = build_model(resolve_dims(CFG, 100), ps, seed=5).train()
    ones = torch.ones(4, 64)
    shared = Dropout(0.5, model.rng, split_across_tp=False)(ones)
    per_rank = Dropout(0.5, model.rng, split_across_tp=True)(ones)
    return {"shared": shared, "per_rank": per_rank}


def test_streams_shared_outside_and_distinct_inside_tp_regions(tmp_path):
    r0, r1 = run_ranks(_streams, 2, tmp_path)
    assert torch.equal(r0["shared"], r1["shared"])
    assert not torch.equal(r0["per_rank"], r1["per_rank"])


def _grads(rank: int, world: int, checkpointing: bool, sequence_parallel: bool) -> dict:
    ps = ParallelState.build(ParallelDims(tp=world))
    torch.manual_seed(11)
    model = build_model(resolve_dims(CFG, 100), ps, seed=11, activation_checkpointing=checkpointing,
                        sequence_parallel=sequence_parallel).train()
    idx = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):  # two steps: the streams must also be left where an uncheckpointed run leaves them
        loss = model(idx, idx)
        loss.backward()
        losses.append(loss.item())
    return {"losses": losses, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_activation_checkpointing_redraws_the_same_masks(tmp_path):
    for sp in (False, True):
        plain = run_ranks(_grads, 2, tmp_path, checkpointing=False, sequence_parallel=sp)
        ckpt = run_ranks(_grads, 2, tmp_path, checkpointing=True, sequence_parallel=sp)
        again = run_ranks(_grads, 2, tmp_path, checkpointing=False, sequence_parallel=sp)
        for rank in range(2):
            assert plain[rank]["losses"] == again[rank]["losses"], "same layout and seed must reproduce"
            assert plain[rank]["losses"] == ckpt[rank]["losses"]
            for name, grad in plain[rank]["grads"].items():
                # same layout, same masks: recomputation only reorders gradient accumulation (fp32 ulps
                # of O(1e-2) gradients); 1e-6 catches a redrawn mask, which moves them by O(1e-2)
                assert torch.allclose(grad, ckpt[rank]["grads"][name], atol=1e-6), (sp, rank, name)
