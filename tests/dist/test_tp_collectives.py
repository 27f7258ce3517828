"""One training step's TP collectives per transformer layer, against Megatron's count:
without SP, 2 all-reduces forward and 2 backward; with SP, 2 all-gathers + 2 reduce-scatters
forward and the mirrored pairs backward, all in single-tensor form (no list all_gather or
reduce_scatter on the TP group)."""
from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel import mappings
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from tests.support.numerics import assert_fp32_close
from tests.support.ranks import run_ranks

COUNTED = ("all_reduce", "all_gather", "reduce_scatter")


def _config(arch: str, num_layers: int) -> ModelConfig:
    """A small model of either flavour (Llama with grouped-query attention)."""
    llama = arch == "llama"
    return ModelConfig(arch=arch, num_layers=num_layers, hidden_size=64, num_attention_heads=4, seq_length=16,
                       ffn_hidden_size=128, num_kv_heads=2 if llama else None,
                       norm="rmsnorm" if llama else "layernorm", activation="swiglu" if llama else "gelu",
                       position_embedding="rope" if llama else "learned", tie_embeddings=not llama, bias=not llama)


def _count_step(rank: int, world: int, arch: str, num_layers: int, sequence_parallel: bool) -> dict:
    cfg = _config(arch, num_layers)
    ps = ParallelState.build(ParallelDims(tp=world))
    model = build_model(resolve_dims(cfg, 100), ps, seed=0, sequence_parallel=sequence_parallel)
    counts: dict[str, collections.Counter] = {"forward": collections.Counter(), "backward": collections.Counter()}
    phase = ["forward"]
    # where each counted collective is called from: the single-tensor gather and reduce-scatter that
    # mappings.py binds, and dist itself (whose list forms must not be used on the TP group at all)
    patched = {("all_reduce", dist, "all_reduce"), ("all_gather", mappings, "_all_gather_single"),
               ("reduce_scatter", mappings, "_reduce_scatter_single"),
               ("list all_gather", dist, "all_gather"), ("list reduce_scatter", dist, "reduce_scatter")}
    originals = {(owner, attr): getattr(owner, attr) for _, owner, attr in patched}

    def counting(name, original):
        def call(*args, **kwargs):
            if kwargs.get("group") is ps.tp_group:
                counts[phase[0]][name] += 1
            return original(*args, **kwargs)
        return call

    for name, owner, attr in patched:
        setattr(owner, attr, counting(name, originals[owner, attr]))
    try:
        idx = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = model(idx, idx)
        phase[0] = "backward"
        loss.backward()
    finally:
        for (owner, attr), fn in originals.items():
            setattr(owner, attr, fn)
    assert not any(c[name] for c in counts.values() for name in ("list all_gather", "list reduce_scatter")), counts
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


def _bucketed_step(rank: int, world: int, arch: str, num_layers: int, micro_batches: int) -> dict:
    """A step of `micro_batches` micro-batches with SP, replicated gradients through one bucket
    (flushed at the last backward), against the same step with the per-use autograd sum."""
    from megaframe.parallel.grad_bucket import ReplicatedGradBucket

    cfg = _config(arch, num_layers)
    ps = ParallelState.build(ParallelDims(tp=world))
    dims = resolve_dims(cfg, 100)
    seen = {"micro": 0}
    bucket = ReplicatedGradBucket(ps.tp_group, is_boundary=lambda: seen["micro"] == micro_batches - 1)
    bucketed = build_model(dims, ps, seed=0, sequence_parallel=True, grad_bucket=bucket)
    per_use = build_model(dims, ps, seed=0, sequence_parallel=True)
    original = dist.all_reduce
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(m)) for m in range(micro_batches)]

    def step(model) -> collections.Counter:
        calls = collections.Counter()

        def counting(tensor, *args, **kwargs):
            if kwargs.get("group") is ps.tp_group:
                calls["on the bucket" if tensor is bucket._flat else "other"] += 1
            return original(tensor, *args, **kwargs)
        dist.all_reduce = counting
        try:
            for seen["micro"], idx in enumerate(batches):
                model(idx, idx).backward()
        finally:
            dist.all_reduce = original
        return calls

    per_use64 = build_model(dims, ps, seed=0, sequence_parallel=True).double()  # the rounding-free answer
    with_bucket, per_use_calls = step(bucketed), step(per_use)
    step(per_use64)
    grads = [(name, a.grad, b.grad, c.grad) for (name, a), b, c in
             zip(bucketed.named_parameters(), per_use.parameters(), per_use64.parameters())]
    return {"bucket": with_bucket["on the bucket"], "saved": per_use_calls["other"] - with_bucket["other"],
            "grads": grads, "bucketed": len(bucket.params)}


@pytest.mark.numerics
@pytest.mark.parametrize("arch, replicated", [("llama", 2), ("gpt2", 6)])
def test_replicated_gradients_are_summed_once_per_step_in_one_bucket(arch, replicated, tmp_path):
    """With a bucket, no per-use all-reduce is left in backward: one all-reduce per step whatever
    the depth and the number of micro-batches, holding the same gradients as the per-use sums."""
    for num_layers, micro_batches in ((1, 1), (3, 2)):
        result = run_ranks(_bucketed_step, 2, tmp_path, arch=arch, num_layers=num_layers,
                           micro_batches=micro_batches)[0]
        uses = replicated * num_layers + (1 if arch == "llama" else 2)  # the blocks' and the final norm's
        assert result["bucketed"] == uses, result
        assert result["bucket"] == 1, result  # one all-reduce on the bucket per step ...
        assert result["saved"] == uses * micro_batches, result  # ... instead of one per use per micro-batch
        # fp32 sums in another order: the same gradients, up to the per-use fp32 step's own rounding
        for name, got, ref32, ref64 in result.pop("grads"):
            assert_fp32_close(got, ref64, ref32, f"{arch} bucketed {name}")
