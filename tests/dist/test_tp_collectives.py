"""One training step's TP collectives per transformer layer, against Megatron's count:
without SP, 2 all-reduces forward and 2 backward; with SP, 2 all-gathers + 2 reduce-scatters
forward and the mirrored pairs backward."""
from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from ranks import run_ranks

COUNTED = ("all_reduce", "all_gather", "reduce_scatter")


def _count_step(rank: int, world: int, arch: str, num_layers: int, sequence_parallel: bool) -> dict:
    llama = arch == "llama"
    cfg = ModelConfig(arch=arch, num_layers=num_layers, hidden_size=64, num_attention_heads=4, seq_length=16,
                      ffn_hidden_size=128, num_kv_heads=2 if llama else None,
                      norm="rmsnorm" if llama else "layernorm", activation="swiglu" if llama else "gelu",
                      position_embedding="rope" if llama else "learned", tie_embeddings=not llama, bias=not llama)
    ps = ParallelState.build(ParallelDims(tp=world))
    model = build_model(resolve_dims(cfg, 100), ps, seed=0, sequence_parallel=sequence_parallel)
    counts: dict[str, collections.Counter] = {"forward": collections.Counter(), "backward": collections.Counter()}
    phase = ["forward"]
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name):
        def call(*args, **kwargs):
            if kwargs.get("group") is ps.tp_group:
                counts[phase[0]][name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        idx = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(idx, idx)
        phase[0] = "backward"
        loss.backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {k: dict(v) for k, v in counts.items()}


def _per_layer(tmp_path, arch: str, sequence_parallel: bool) -> dict:
    """Counts of a 2-layer step minus a 1-layer step: what one transformer layer adds."""
    one = run_ranks(_count_step, 2, tmp_path, arch=arch, num_layers=1, sequence_parallel=sequence_parallel)[0]
    two = run_ranks(_count_step, 2, tmp_path, arch=arch, num_layers=2, sequence_parallel=sequence_parallel)[0]
    return {phase: {name: two[phase].get(name, 0) - one[phase].get(name, 0) for name in COUNTED}
            for phase in ("forward", "backward")}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_megatron_count_without_sp(arch, tmp_path):
    per_layer = _per_layer(tmp_path, arch, sequence_parallel=False)
    assert per_layer == {"forward": {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0},
                         "backward": {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0}}


@pytest.mark.parametrize("arch, replicated_grad_syncs", [("llama", 2), ("gpt2", 6)])
def test_megatron_count_with_sp(arch, replicated_grad_syncs, tmp_path):
    """The all-reduces left in backward sum the gradients of parameters replicated across TP ranks
    but used on sequence shards: the two norm gains (llama); gpt2 adds the two norm biases and the
    two row-parallel biases. Megatron sums the same gradients, bucketed after the backward pass."""
    per_layer = _per_layer(tmp_path, arch, sequence_parallel=True)
    assert per_layer == {"forward": {"all_reduce": 0, "all_gather": 2, "reduce_scatter": 2},
                         "backward": {"all_reduce": replicated_grad_syncs, "all_gather": 2, "reduce_scatter": 2}}
