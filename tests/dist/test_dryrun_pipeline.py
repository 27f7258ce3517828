"""The meta-device dry run holds, rank by rank, exactly the parameters DeepSpeed's real PipelineModule
builds on that rank (tp=2 x pp=2 and pp=4 on gloo; tied GPT-2 embedding and untied Llama head; both
partition methods)."""
from __future__ import annotations

import pytest

from tests.support.ranks import run_ranks

SHAPES = {"gpt2": dict(num_layers=5), "llama": dict(num_layers=5, arch="llama", norm="rmsnorm", activation="swiglu",
                                                      position_embedding="rope", tie_embeddings=False, bias=False,
                                                      num_kv_heads=2)}


def _held(rank: int, world: int, tp: int, pp: int) -> list[tuple]:
    from megaframe.config.schema import ModelConfig
    from megaframe.backends.deepspeed.engine import init_distributed
    from megaframe.model.factory import resolve_dims
    from megaframe.backends.deepspeed.pipeline import build_pipeline_model
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState
    from megaframe.plan.dryrun import dry_run
    from megaframe.plan.memory import stage_parameters

    init_distributed()  # PipelineModule talks to deepspeed.comm
    out = []
    ps = ParallelState.build(ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp)))
    for flavour, shape in SHAPES.items():
        dims = resolve_dims(ModelConfig(hidden_size=64, num_attention_heads=4, seq_length=16, **shape), 100, tp=tp)
        for partition in ("uniform", "parameters"):
            real = build_pipeline_model(dims, ps, seed=1, partition=partition)
            held = sum(p.numel() for p in real.parameters())
            dry = dry_run(dims, ps.grid, rank, partition).parameters
            planned = stage_parameters(dims, tp, pp, ps.pp_rank, partition)
            out.append((flavour, partition, held, dry, planned))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 4)])
def test_dry_run_equals_the_real_pipeline_stage(tp, pp, tmp_path):
    for rank, results in enumerate(run_ranks(_held, tp * pp, tmp_path, tp=tp, pp=pp)):
        for flavour, partition, held, dry, planned in results:
            assert held == dry == planned, f"rank {rank} {flavour} {partition}: real {held}, dry run {dry}, planner {planned}"
