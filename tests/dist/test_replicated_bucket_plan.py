"""The planner counts DeepSpeed's fp32 bucket of TP-replicated gradients (parallel/grad_bucket.py),
kept for the whole run at ZeRO-0/1 with tp > 1: built at tp=2 on two gloo ranks, the bucket the
model's backward fills holds exactly the parameters plan/memory.py's stage_replicated_parameters
counts. An MoE block's experts and router go through it (each TP rank routes its own tokens): the
planner left them out, 21 GiB a rank for mixtral_8x7b as shipped, and passed layouts that OOM."""
from __future__ import annotations

import pytest
import torch

from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from megaframe.plan.memory import stage_replicated_parameters
from tests.support.ranks import run_ranks

# every kind of replicated parameter: experts and a router (MoE), a shared expert's row-parallel
# bias, one kv head under tp=2 (replicated k/v projections), q/k norms, layer norms and biases (SP)
CASES = {
    "moe": dict(arch="llama", num_kv_heads=1, qk_norm=True, norm="rmsnorm", activation="swiglu", bias=False,
                position_embedding="rope", tie_embeddings=False,
                moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, shared_experts=1)),
    "dense with biases": dict(arch="gpt2", norm="layernorm", activation="gelu", bias=True,
                              position_embedding="learned", tie_embeddings=True),
}


def _bucket_size(rank: int, world: int, case: str, sequence_parallel: bool) -> dict:
    from megaframe.parallel.grad_bucket import ReplicatedGradBucket

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, ffn_hidden_size=128,
                      **CASES[case])
    ps = ParallelState.build(ParallelDims(tp=world))
    dims = resolve_dims(cfg, 100)
    bucket = ReplicatedGradBucket(ps.tp_group)
    model = build_model(dims, ps, seed=0, sequence_parallel=sequence_parallel, grad_bucket=bucket)
    idx = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()
    moe_blocks = dims.num_moe_blocks
    flat = bucket._flat if bucket._flat is not None else torch.zeros(0)  # nothing replicated: never made
    return {"held": flat.numel(), "dtype": str(flat.dtype),
            "planned": stage_replicated_parameters(dims, world, sequence_parallel, dims.num_layers - moe_blocks,
                                                   moe_blocks, last=True)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_planner_counts_the_bucket_the_backward_fills(case, sequence_parallel, tmp_path):
    for result in run_ranks(_bucket_size, 2, tmp_path, case=case, sequence_parallel=sequence_parallel):
        assert result["dtype"] == "torch.float32"
        assert result["held"] == result["planned"], result
        # a dense block without sequence parallelism splits every parameter over TP: nothing to sum
        assert (result["held"] > 0) == (case == "moe" or sequence_parallel), result
