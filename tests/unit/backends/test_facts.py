"""Each engine's facts (backends/facts.py, held by its plug.py) against its own rules: the layout
search and validation read the facts, the CLI refuses by the rules, and the two must say the same
thing, or the planner would suggest a layout the engine refuses (or never suggest one it runs)."""
from __future__ import annotations

import dataclasses

import pytest

from megaframe.backends.registry import ENGINES, engine, validate_for_engine
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError, resolve_layout
from megaframe.parallel.pipeline_schedules import SPLIT_BACKWARD


def _cfg(name: str, stage: int, pp: int = 1, **parallel) -> TrainConfig:
    cfg = TrainConfig()
    cfg.backend.name, cfg.zero.stage = name, stage
    cfg.model.num_layers = 4
    cfg.parallel.pp = pp
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_the_facts_say_what_the_engines_rules_run(name):
    plug = engine(name)
    facts, runs = plug.facts, (lambda cfg: plug.config_problem(cfg) is None)
    for pp, stages in ((1, facts.zero_stages), (2, facts.pipeline_zero_stages)):
        assert [s for s in range(4) if runs(_cfg(name, s, pp))] == list(stages), (name, pp)
    for stage in facts.zero_stages:
        optimizer = _cfg(name, stage)
        optimizer.offload.optimizer = "cpu"  # the search tries optimizer offload at every sharding stage
        assert runs(optimizer) == (stage > 0), (name, stage)
        alone = _cfg(name, stage)
        alone.offload.param = "cpu"
        assert runs(alone) == (stage in facts.param_offload_stages), (name, stage)
    moe = _cfg(name, facts.pipeline_zero_stages[0], 2)
    moe.model.moe.num_experts = 4
    assert runs(moe), name  # every engine pipelines MoE blocks
    for schedule, virtual in facts.pipeline_schedules:
        for s in facts.pipeline_zero_stages:
            cfg = _cfg(name, s, 2, pipeline_schedule=schedule, virtual_stages=virtual)
            assert runs(cfg) == (schedule not in SPLIT_BACKWARD or s in facts.split_backward_zero_stages), \
                (name, schedule, s)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_the_micro_batch_fact_is_the_engines_layout_rule(name):
    """One micro-batch per step through two pipeline stages: an engine whose pipeline needs m >= p
    (torch's schedules) refuses it, DeepSpeed's 1F1B runs it; the search skips what the rule refuses."""
    plug = engine(name)
    cfg = _cfg(name, plug.facts.pipeline_zero_stages[0], 2, dp=1, micro_batch_size=1, global_batch_size=1)
    layout = resolve_layout(cfg, 2)
    assert layout.grad_accum_steps == 1
    assert (plug.layout_problem(cfg, layout) is not None) == plug.facts.schedules_need_micro_batches


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_a_whole_model_graph_is_refused_where_the_engine_gathers_per_module(name):
    """train.compile_scope=model with every stage the engine runs: validation refuses exactly the
    stages its facts say gather parameters per module (DeepSpeed: ZeRO-3; FSDP2: every stage it runs),
    naming the engine and the stage, as before the facts (the registry hands them over)."""
    facts = engine(name).facts
    for stage in facts.zero_stages:
        cfg = _cfg(name, stage)
        cfg.train.compile, cfg.train.compile_scope = True, "model"
        if stage in facts.per_module_gather_stages:
            with pytest.raises(ConfigError, match=rf"which backend={name} zero={stage} cannot run in"):
                validate_for_engine(cfg, 1, ask_bf16=False)
        else:
            assert validate_for_engine(cfg, 1, ask_bf16=False).world_size == 1
    assert set(facts.per_module_gather_stages) <= set(facts.zero_stages)


def test_the_plain_engine_keeps_the_named_engines_facts():
    """run_engine's one-process stand-in was validated and planned as DeepSpeed: its plug keeps
    DeepSpeed's facts and rules and changes only what builds and steps."""
    from megaframe.backends.registry import run_engine

    cfg = TrainConfig()
    plain, named = run_engine(cfg, 1), engine(cfg.backend.name)
    assert plain.name == "plain" and named.name == "deepspeed"
    assert plain.facts is named.facts and plain.config_problem is named.config_problem
    assert plain.build is not named.build
    assert all(dataclasses.is_dataclass(f) for f in (named.facts, named.facts.memory))


def test_the_planner_reads_the_facts_without_importing_torch_or_an_engine():
    """The planner's search and a refused config stay cheap: every engine's facts, and the planner
    that reads them, come without torch (let alone DeepSpeed or torch.distributed.fsdp)."""
    import subprocess
    import sys

    probe = ("import sys; from megaframe.backends.registry import ENGINES, engine_facts; import megaframe.plan.search; "
             "[engine_facts(name) for name in ENGINES]; "
             "print(sorted(m for m in ('torch', 'deepspeed', 'torch.distributed.fsdp') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_deepspeeds_zero0_gradient_copy_follows_the_optimizer_it_picks(dtype, pipelined):
    """At ZeRO-0 the planner counts an fp32 copy of the gradients at the step exactly where DeepSpeed
    wraps the optimizer in its FP16 optimizers (bf16 without a pipeline, fp16 with or without), not
    where it keeps fp32 or uses the pipeline's BF16_Optimizer: asked of DeepSpeed's own choice
    (DeepSpeedEngine._do_optimizer_sanity_check) for a stand-in engine of that precision."""
    import types

    import torch
    from deepspeed.runtime.constants import DDP_BFLOAT16, FP16
    from deepspeed.runtime.engine import DeepSpeedEngine

    model_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    stand_in = types.SimpleNamespace(get_data_types=lambda: (model_dtype, model_dtype),
                                     zero_optimization=lambda: False, pipeline_parallelism=pipelined)
    wrapper = DeepSpeedEngine._do_optimizer_sanity_check(stand_in, torch.optim.AdamW([torch.zeros(1)]))
    copied = engine("deepspeed").facts.memory.fp32_gradient_copy_at_step(0, pipelined, dtype, False)
    assert (copied is not None) == (wrapper in (FP16, DDP_BFLOAT16)), (wrapper, copied)
