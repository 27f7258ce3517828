"""Every recipe composes and validates; its size matches the published one; the meta-device dry run
of a rank on its first, a middle and its last pipeline stage holds exactly what the planner counts."""
from __future__ import annotations

import time

import torch

import pytest

from megaframe.backends.registry import engine
from megaframe.config.compose import compose
from megaframe.config.validate import validate
from megaframe.model.factory import resolve_dims
from megaframe.common.paths import recipes_dir
from megaframe.plan.cli import planned_world_size
from megaframe.parallel.dims import ParallelDims
from megaframe.plan.dryrun import dry_run
from megaframe.plan.memory import active_parameters, stage_parameters, total_parameters

# Published sizes: ../shared/REFERENCE.md, and for Llama-3 8B / NeoX-20B their papers (8.03B, 20.55B).
PUBLISHED = {"llama2_7b": 6.74e9, "llama2_13b": 13.0e9, "llama2_70b": 69.0e9, "llama3_8b": 8.03e9,
             "llama3_8b_128k": 8.03e9,
             "neox_20b": 20.55e9, "gpt3_175b": 175e9, "mtnlg_530b": 530e9, "gpt_1t": 1.0e12,
             "mixtral_8x7b": 46.70e9, "qwen3_30b_a3b": 30.5e9, "qwen3_235b_a22b": 235e9}

DEEPSPEED_RULES = engine("deepspeed").config_problem  # the suggested layouts must be ones DeepSpeed runs


def _recipe(name: str):
    cfg, _ = compose([f"recipe={name}"])
    layout = validate(cfg, planned_world_size(cfg), fp16_supported=lambda: False, engine_problem=DEEPSPEED_RULES)
    return cfg, layout, resolve_dims(cfg.model, cfg.model.vocab_size, tp=layout.tp)


def test_every_recipe_file_is_covered():
    assert sorted(p.stem for p in recipes_dir().glob("*.yaml")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_composes_validates_and_has_its_published_size(name):
    cfg, layout, dims = _recipe(name)
    assert cfg.precision.dtype == "bf16" and cfg.parallel.activation_checkpointing
    assert cfg.logging.wandb.group == name  # W&B groups runs by recipe
    assert layout.world_size == layout.tp * layout.pp * layout.cp * layout.dp > 1
    assert total_parameters(dims) == pytest.approx(PUBLISHED[name], rel=0.01)


def test_the_128k_recipe_fits_an_h100_only_with_context_parallelism():
    """131072 tokens per sequence: the planner puts a rank at 224.8 GiB without cp (activations of
    the whole sequence, even with full recomputation) and within 80 GiB at the recipe's cp=8."""
    from megaframe.plan.estimate import estimate_config

    cfg, layout, _ = _recipe("llama3_8b_128k")
    assert layout.cp == 8 and cfg.cluster.name == "h100_80g"
    assert estimate_config(cfg, layout).fits
    whole, _ = compose(["recipe=llama3_8b_128k", "parallel.cp=1", "parallel.dp=64", "parallel.global_batch_size=64"])
    assert not estimate_config(whole, validate(whole, 64, fp16_supported=lambda: False, engine_problem=DEEPSPEED_RULES)).fits


def test_mixtral_with_four_expert_ranks_does_not_fit_for_its_experts_fp32_gradient_bucket():
    """At tp=4 ZeRO-1 every TP rank routes its own tokens through its experts, whose gradients DeepSpeed
    sums over TP in one fp32 bucket kept all run (tests/dist/test_replicated_bucket_plan.py measures
    it): two experts a block at ep=4, 42 GiB. The planner left it out and called ep=4 64.3 GiB, fits."""
    from megaframe.plan.estimate import estimate_config

    cfg, layout, _ = _recipe("mixtral_8x7b")
    assert (layout.tp, cfg.parallel.ep, cfg.zero.stage, cfg.cluster.name) == (4, 8, 1, "h100_80g")
    assert estimate_config(cfg, layout).fits
    fewer, _ = compose(["recipe=mixtral_8x7b", "parallel.ep=4"])
    assert not estimate_config(fewer, validate(fewer, planned_world_size(fewer), fp16_supported=lambda: False,
                                               engine_problem=DEEPSPEED_RULES)).fits


def test_llama2_7b_is_exactly_its_reference_size():
    assert total_parameters(_recipe("llama2_7b")[2]) == 6_738_415_616


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dry_run_matches_planner_on_first_middle_and_last_stage(name):
    cfg, layout, dims = _recipe(name)
    tp, pp = layout.tp, layout.pp
    start = time.perf_counter()
    for stage in sorted({0, pp // 2, pp - 1}):
        for tp_rank in sorted({0, tp - 1}):
            built = dry_run(dims, layout.grid, layout.grid.rank(pp=stage, tp=tp_rank), cfg.parallel.pipeline_partition)
            assert built.stage == stage and built.tp_rank == tp_rank
            assert built.parameters == stage_parameters(dims, tp, pp, stage, cfg.parallel.pipeline_partition,
                                                        layout.grid.ep), \
                f"{name} stage {stage} tp rank {tp_rank}: {built.layers}"
    assert time.perf_counter() - start < 60  # seconds, even for gpt_1t (DeepSpeed's partitioner is the slow part)


def test_dry_run_of_a_whole_model_counts_every_tp_shard_once():
    cfg, layout, dims = _recipe("llama2_13b")  # tp=2, pp=1
    shards = [dry_run(dims, ParallelDims(tp=2), rank).parameters for rank in range(2)]
    # TP splits everything except norms (replicated on both ranks)
    norms = (2 * dims.num_layers + 1) * dims.hidden_size
    assert sum(shards) - norms == total_parameters(dims)


def _active_from_modules(dims) -> int:
    """Parameters a token meets, counted on the meta-device model: every tensor, but of each stacked
    expert tensor only top_k of its E experts (an independent count of the planner's formula)."""
    from megaframe.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(dims)
    active = 0
    for name, p in model.named_parameters():
        active += p.numel() * dims.moe.top_k // dims.moe.num_experts if ".experts." in name else p.numel()
    return active


@pytest.mark.parametrize("name, active", [("mixtral_8x7b", 12.88e9), ("qwen3_30b_a3b", 3.3e9),
                                          ("qwen3_235b_a22b", 22e9)])
def test_moe_recipes_have_their_published_active_parameters(name, active):
    """Mixtral: 46.70B / 12.88B (REFERENCE.md), and Qwen3-235B-A22B's card, 235B / 22B (non-embedding
    234B), within 1%. Qwen3-30B-A3B's card gives 30.5B and 3.3B
    truncated to its digits (non-embedding 29.9B): the count is 30.53B / 3.353B, which truncates to
    them; 3.353B is 1.6% above the written 3.3."""
    cfg, layout, dims = _recipe(name)
    assert layout.grid.ep > 1 and dims.moe is not None
    counted = active_parameters(dims)
    assert counted == _active_from_modules(dims)
    embedding = dims.vocab_size * dims.hidden_size * 2  # untied input and output tables
    if name != "qwen3_30b_a3b":
        assert counted == pytest.approx(active, rel=0.01)
        if name == "qwen3_235b_a22b":
            assert total_parameters(dims) - embedding == pytest.approx(234e9, rel=0.01)
    else:
        assert int(counted / 1e8) == int(active / 1e8) and int(total_parameters(dims) / 1e8) == 305
        assert total_parameters(dims) - embedding == pytest.approx(29.9e9, rel=0.01)
