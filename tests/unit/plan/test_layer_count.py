"""The planner's cost does not grow with the layer count (issue 50, Build 9): it counts layers by
kind (dense block, MoE block, embedding, final norm, head), never one by one. `model.num_layers=
100000000` built a Python object per layer in megaframe-plan and the pre-launch check (3.5 GB in
100 s, no output); now it plans in well under a second, and absurd sizes are one line.

The per-kind counts are checked against the per-layer reference they replace: DeepSpeed's balanced
partition (partition_balanced, itself checked against DeepSpeed's in test_memory.py) over the
per-layer weights, summed layer by layer."""
from __future__ import annotations

import contextlib
import io
import json
import resource
import time

import pytest

from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.model.dims import resolve_dims
from megaframe.plan.cli import main as plan_main
from megaframe.plan.memory import (block_expert_parameters, partition_balanced, pipeline_layer_parameters,
                                   stage_blocks, stage_expert_parameters, stage_parameters, uniform_stage_range,
                                   uniform_weights)


def test_the_uniform_partition_in_closed_form_is_deepspeeds():
    """Every layer count up to 24 and every pipeline depth up to it, and deeper models at a few depths
    (checked for every count up to 64 when written): the O(1) stage range is the DP's."""
    shapes = [(layers, pp) for layers in range(1, 25) for pp in range(2, layers + 1)]
    for layers, pp in shapes + [(61, 16), (64, 7), (96, 5), (80, 40)]:
        weights = [0, *[1] * layers, 0, 0]
        parts = partition_balanced(weights, pp)
        assert [0] + [uniform_stage_range(layers, pp, s)[1] for s in range(pp)] == parts, (layers, pp)


MOE = [MoEConfig(num_experts=4, top_k=2), MoEConfig(num_experts=4, top_k=1, layer_freq=2, first_dense_layers=1),
       MoEConfig(num_experts=8, top_k=2, layer_freq=3, first_dense_layers=2, shared_experts=1)]


@pytest.mark.parametrize("moe", MOE)
def test_moe_blocks_in_a_range_are_counted_without_a_loop(moe):
    dims = resolve_dims(ModelConfig(num_layers=13, hidden_size=32, num_attention_heads=4, moe=moe), 100)
    for start in range(14):
        for stop in range(14):
            assert dims.moe_blocks_in(start, stop) == sum(dims.is_moe_block(i) for i in range(start, stop))
    assert dims.num_moe_blocks == sum(dims.is_moe_block(i) for i in range(13))


def _reference(dims, tp, pp, stage, partition, ep):
    """The per-layer count this replaces: cut the per-layer weights, sum the stage's layers."""
    per_layer = pipeline_layer_parameters(dims, tp, ep)
    weights = uniform_weights(dims) if partition == "uniform" else per_layer
    parts = partition_balanced(list(weights), pp) if pp > 1 else [0, len(per_layer)]
    start, stop = parts[stage], parts[stage + 1]
    held = sum(per_layer[start:stop])
    if dims.tie_embeddings and start == 0 and stop == len(per_layer):
        held -= per_layer[-1]
    blocks = [i - 1 for i in range(start, stop) if 1 <= i <= dims.num_layers]
    experts = sum(block_expert_parameters(dims, b, ep) for b in blocks) if dims.moe else 0
    return held, len(blocks), sum(dims.is_moe_block(b) for b in blocks), experts


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("moe", [MoEConfig(), *MOE[1:]])
def test_stage_counts_by_kind_equal_the_per_layer_sums(tied, moe):
    dims = resolve_dims(ModelConfig(num_layers=11, hidden_size=32, num_attention_heads=4, tie_embeddings=tied,
                                    moe=moe), 100)
    ep = 2 if moe.num_experts else 1
    for partition in ("uniform", "parameters"):
        for pp in (1, 2, 3, 5, 11):
            for stage in range(pp):
                held, blocks, moe_blocks, experts = _reference(dims, 2, pp, stage, partition, ep)
                assert stage_parameters(dims, 2, pp, stage, partition, ep) == held, (partition, pp, stage)
                assert stage_blocks(dims, 2, pp, stage, partition, ep=ep) == blocks
                assert stage_blocks(dims, 2, pp, stage, partition, moe_only=True, ep=ep) == moe_blocks
                assert stage_expert_parameters(dims, 2, pp, stage, partition, ep) == experts


HUGE = "model.num_layers=100000000"
PLANS = [([HUGE, "parallel.pp=8", "parallel.global_batch_size=64"], 12_500_000),
         ([HUGE, "model=moe_tiny", "parallel.pp=4", "parallel.global_batch_size=32"], 25_000_000),
         ([HUGE, "parallel=auto", "cluster=h100_80g", "launcher.nodes=16", "parallel.micro_batch_size=1",
           "parallel.global_batch_size=1024"], 100_000_000)]


@pytest.fixture(scope="module")
def warm():
    """One plan first: the first imports (torch, Hydra, the tokenizer) are no part of what is measured."""
    with contextlib.redirect_stdout(io.StringIO()):
        plan_main(["--json"])


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@pytest.mark.parametrize("args,blocks", PLANS, ids=["pp8", "moe-pp4", "auto-128-ranks"])
def test_a_hundred_million_layers_plan_in_a_fraction_of_a_second(args, blocks, capsys, warm):
    rss, started = _max_rss_bytes(), time.process_time()  # CPU time: other jobs on the host do not count
    plan_main(["--json", *args])
    seconds, grown = time.process_time() - started, _max_rss_bytes() - rss
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["stages"][0]["blocks"] == blocks and not plan["fits"], plan["stages"][0]
    # Hydra's composition is most of it (about 0.4 s); a Python object per layer was 100 s and 3.5 GB
    assert seconds < 5 and grown < 200 * 2**20, (seconds, grown)


@pytest.mark.parametrize("args,line", [
    ([HUGE, "parallel.pp=4", "parallel.pipeline_partition=parameters"],
     "parallel.pipeline_partition=parameters with model.num_layers=100000000"),
    ([HUGE, "model.hidden_size=100000", "model.num_attention_heads=100"], "the model has 4.0"),
    (["model.num_layers=3000000000"], "model.num_layers=3000000000 is beyond the 32-bit sizes"),
    # the meta-device build of one rank is per layer by nature: 20 GB before the OOM killer came
    ([HUGE, "parallel.pp=2", "parallel.global_batch_size=32", "--dry-run=1"],
     "--dry-run=1: the model holds 100,000,000 blocks"),
])
def test_what_no_machine_can_run_is_one_line(args, line, capsys):
    with pytest.raises(SystemExit) as ended:
        plan_main(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and line in lines[0], lines
