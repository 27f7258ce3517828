"""Layout search: only layouts validation and DeepSpeed accept, ranked, and parallel=auto's overrides."""
from __future__ import annotations

import json

import pytest

from megaframe.backends.registry import engine
from megaframe.config.compose import compose
from megaframe.config.validate import validate
from megaframe.plan.cli import planned_world_size
from megaframe.plan.estimate import estimate_config, plan_layout
from megaframe.plan.search import candidate_layouts, fitting_layouts, layout_overrides

DEEPSPEED_RULES = engine("deepspeed").config_problem  # the suggested layouts must be ones DeepSpeed runs


def test_candidates_are_legal_and_keep_the_world_and_batch():
    cfg, _ = compose(["recipe=llama2_70b", "cluster=h100_80g"])
    base = plan_layout(cfg, validate(cfg, planned_world_size(cfg), fp16_supported=lambda: False, engine_problem=DEEPSPEED_RULES))
    seen = list(candidate_layouts(cfg.model, base, 8))
    assert len(seen) > 50
    for lay in seen:
        assert lay.world_size == base.world_size == 512 and lay.tp <= 8
        assert lay.global_batch_size % (lay.micro_batch_size * lay.dp) == 0
        assert cfg.model.num_attention_heads % lay.tp == 0 and lay.pp <= cfg.model.num_layers
        assert lay.pp == 1 or lay.zero_stage <= 1  # DeepSpeed's pipeline engine: ZeRO 0-1
        assert lay.offload_param == "none" or lay.zero_stage == 3
        assert not lay.sequence_parallel or lay.tp > 1


def test_fitting_layouts_fit_are_ranked_and_their_overrides_validate():
    cfg, _ = compose(["recipe=llama2_70b", "cluster=h100_80g", "parallel.tp=1", "parallel.pp=1", "parallel.dp=512"])
    layout = validate(cfg, 512, fp16_supported=lambda: False, engine_problem=DEEPSPEED_RULES)
    assert not estimate_config(cfg, layout).fits
    best = fitting_layouts(cfg, plan_layout(cfg, layout), limit=5)
    assert best and all(e.fits for e in best)
    assert [e.ranked_step_time_s for e in best] == sorted(e.ranked_step_time_s for e in best)
    chosen, _ = compose(["recipe=llama2_70b", "cluster=h100_80g", *layout_overrides(best[0].layout)])
    again = estimate_config(chosen, validate(chosen, 512, fp16_supported=lambda: False, engine_problem=DEEPSPEED_RULES))
    assert again.layout == best[0].layout and again.peak == best[0].peak


def test_fsdp2_candidates_are_layouts_fsdp2_runs_and_the_best_fits():
    """backend=fsdp2 searches FSDP2's own layouts (each passes its rules: ZeRO 2/3, offload of all or
    nothing, pipelines with 1F1B, interleaved 1F1B and ZBV, the split-backward ZBV at ZeRO-2 only),
    and for a 70B model on 512 H100s finds ones that fit; parallel=auto hands the winner's overrides
    to the ranks, which validate under FSDP2's rules."""
    fsdp2 = ["recipe=llama2_70b", "cluster=h100_80g", "backend=fsdp2", "zero=stage3", "parallel.pp=1", "parallel.tp=8",
             "parallel.dp=64"]
    cfg, _ = compose(fsdp2)
    plug = engine("fsdp2")
    rules = {"engine_problem": plug.config_problem, "engine_layout_problem": plug.layout_problem}
    base = plan_layout(cfg, validate(cfg, planned_world_size(cfg), fp16_supported=lambda: False, **rules))
    seen = list(candidate_layouts(cfg.model, base, 8))
    assert len(seen) > 10 and {lay.zero_stage for lay in seen} == {2, 3} and max(lay.pp for lay in seen) > 1
    assert {lay.pipeline_schedule for lay in seen if lay.pp > 1} == {"1f1b", "interleaved_1f1b", "zbv"}
    assert not any(lay.zero_stage == 3 and lay.pipeline_schedule == "zbv" for lay in seen)
    for lay in seen[::7]:  # every seventh: each composes and validates in about 50 ms
        again, _ = compose([*fsdp2, *layout_overrides(lay)])
        validate(again, 512, fp16_supported=lambda: False, **rules)
    best = fitting_layouts(cfg, base, limit=3)
    assert best and all(e.fits and e.layout.engine == "fsdp2" for e in best)


def test_plan_engines_lets_parallel_auto_choose_between_the_engines():
    """plan.engines=[deepspeed,fsdp2]: the search ranks both engines' layouts together, and the
    winner's overrides name its engine."""
    args = ["recipe=llama2_70b", "cluster=h100_80g", "parallel.tp=8", "parallel.pp=1", "parallel.dp=64"]
    cfg, _ = compose([*args, "plan.engines=[deepspeed,fsdp2]"])
    base = plan_layout(cfg, validate(cfg, 512, fp16_supported=lambda: False, engine_problem=DEEPSPEED_RULES))
    ranked = fitting_layouts(cfg, base, limit=10_000)
    assert {e.layout.engine for e in ranked} == {"deepspeed", "fsdp2"}
    only_deepspeed = fitting_layouts(compose(args)[0], base, limit=10_000)
    assert {e.layout.engine for e in only_deepspeed} == {"deepspeed"}
    assert f"backend.name={ranked[0].layout.engine}" in layout_overrides(ranked[0].layout)


def test_an_unknown_engine_in_plan_engines_is_one_line(capsys):
    from megaframe.launch.checks import check

    with pytest.raises(SystemExit):
        check(["plan.engines=[deepspeed,megatron]"])
    line = capsys.readouterr().err.strip()
    assert "plan.engines holds 'megatron'" in line and "deepspeed, fsdp2" in line and "\n" not in line


def test_hsdp_candidates_hold_the_configured_replicas_and_each_estimates():
    """parallel.dp_replicate=2 under fsdp2: the replicas are an axis of every candidate's grid, layouts
    whose dp x cp ranks cannot hold two replicas are no candidates (the run refuses them; the search
    divided by zero on them), each candidate estimates, and its dense states shard over dp x cp / 2."""
    args = ["model=gpt_tiny", "backend=fsdp2", "zero=stage3", "parallel.dp=8", "parallel.dp_replicate=2",
            "parallel.global_batch_size=64"]
    cfg, _ = compose(args)
    plug = engine("fsdp2")
    base = plan_layout(cfg, validate(cfg, 8, fp16_supported=lambda: False, engine_problem=plug.config_problem,
                                     engine_layout_problem=plug.layout_problem))
    assert base.grid.dp_replicate == 2
    seen = list(candidate_layouts(cfg.model, base, 8))
    assert {lay.grid.size("dp", "cp") for lay in seen} == {2, 4, 8}
    assert all(lay.grid.dp_replicate == 2 for lay in seen)
    assert fitting_layouts(cfg, base, limit=10_000)
    hsdp = estimate_config(cfg, validate(cfg, 8, fp16_supported=lambda: False, engine_problem=plug.config_problem))
    plain, _ = compose([*args[:-2], "parallel.global_batch_size=64"])
    sharded = estimate_config(plain, validate(plain, 8, fp16_supported=lambda: False, engine_problem=plug.config_problem))
    assert hsdp.stages[0].states.optimizer == 2 * sharded.stages[0].states.optimizer


def test_parallel_auto_proposes_only_layouts_the_optimizer_steps():
    """optim=muon under DeepSpeed: the search keeps to layouts Muon's rule accepts (no ZeRO-0 over more
    than one rank, nothing offloaded: the rule refuses those, which plain AdamW's search proposes),
    and each proposed layout's overrides validate with the engine's and the optimizer's rules."""
    from megaframe.backends.registry import validate_for_engine
    args = ["model=llama_tiny", "cluster=h100_80g", "parallel.micro_batch_size=1", "parallel.dp=4",
            "zero=stage1", "launcher.nodes=1", "cluster.gpus_per_node=4"]
    cfg, _ = compose([*args, "optim=muon"])
    base = plan_layout(cfg, validate_for_engine(cfg, 4, ask_bf16=False))
    refused = lambda lay: (lay.zero_stage == 0 and lay.world_size > 1) or "cpu" in (lay.offload_optimizer, lay.offload_param)  # noqa: E731
    adamw = fitting_layouts(compose([*args, "optim=adamw"])[0], base, limit=10_000)
    assert any(refused(e.layout) for e in adamw)  # the search would propose them
    muon = fitting_layouts(cfg, base, limit=10_000)
    assert muon and not any(refused(e.layout) for e in muon)
    for e in muon[::10]:
        again, _ = compose([*args, "optim=muon", *layout_overrides(e.layout)])
        validate_for_engine(again, 4, ask_bf16=False)


def test_parallel_auto_proposes_no_tp_the_mxfp8_widths_refuse():
    """An MLP of 4000 under MXFP8: 4000/tp must be a multiple of 32, so tp=2 (2000) is refused at launch;
    parallel=auto chose it and the launch refused it (feature review). tp=1 (4000) passes."""
    from megaframe.backends.registry import validate_for_engine
    args = ["model.hidden_size=1024", "model.num_attention_heads=8", "model.ffn_hidden_size=4000", "precision=fp8",
            "precision.fp8.recipe=mxfp8", "parallel.dp=2", "cluster=h100_80g", "launcher.nodes=1",
            "cluster.gpus_per_node=2"]
    cfg, _ = compose(args)
    base = plan_layout(cfg, validate_for_engine(cfg, 2, ask_bf16=False))
    proposed = fitting_layouts(cfg, base, limit=10_000)
    assert proposed and {e.layout.tp for e in proposed} == {1}
    bf16 = fitting_layouts(compose([a for a in args if "fp8" not in a])[0], base, limit=10_000)
    assert {e.layout.tp for e in bf16} == {1, 2}  # without the rule the search proposes tp=2
    # tensorwise fp8 kernels on the cluster's GPUs: widths per rank a multiple of 16; an MLP of 4016 / tp=2 is
    # 2008 (refused at launch), / tp=1 passes. Emulated, both run.
    kernels = ["model.ffn_hidden_size=4016", "precision=fp8", *args[0:2], *args[5:]]
    cfg, _ = compose(kernels)
    assert {e.layout.tp for e in fitting_layouts(cfg, base, limit=10_000)} == {1}
    cfg, _ = compose([*kernels, "precision.fp8.emulate=true"])
    assert {e.layout.tp for e in fitting_layouts(cfg, base, limit=10_000)} == {1, 2}


@pytest.mark.parametrize("mask", ["data.document_mask=true", "model.sliding_window=4096"])
def test_parallel_auto_proposes_no_cp_layout_the_masks_refuse(mask):
    """Llama 3 8B at 128k tokens with documents or a window: under Ulysses the search proposes no
    cp > 1 layout (the launch refuses Ulysses with a restricting mask, for its dense mask); under the
    ring it does, pipeline stages over cp shards too (the stages gather the rows' ids over cp); every
    proposal passes the masks' rule."""
    from megaframe.config.attention_rules import layout_problem

    args = ["recipe=llama3_8b_128k", mask, "parallel.cp=1", "parallel.dp=64",
            "parallel.global_batch_size=64"]  # 64 ranks, a base both cores run
    proposals = {}
    for core in ("ring", "ulysses"):
        cfg, _ = compose([*args, f"parallel.cp_impl={core}"])
        base = plan_layout(cfg, validate(cfg, planned_world_size(cfg), fp16_supported=lambda: False,
                                         engine_problem=DEEPSPEED_RULES))
        proposals[core] = [e.layout for e in fitting_layouts(cfg, base, limit=10_000)]
        for lay in proposals[core][::25]:
            again, _ = compose([*args, f"parallel.cp_impl={core}", *layout_overrides(lay)])
            assert layout_problem(again) is None, layout_overrides(lay)
    assert any(lay.cp > 1 for lay in proposals["ring"])
    assert any(lay.cp > 1 and lay.pp > 1 for lay in proposals["ring"])
    assert proposals["ulysses"] and all(lay.cp == 1 for lay in proposals["ulysses"])


@pytest.mark.parametrize("core", ["ulysses", "flex"])
def test_parallel_auto_proposes_no_cp_layout_the_attention_cores_refuse(core):
    """Llama 3 8B at 128k tokens (32 query heads, 8 kv heads) on 64 ranks: Ulysses is proposed only at a
    cp dividing the heads (cp=16 was offered and refused), FlexAttention at none (it attends on one
    rank's tokens); each proposal validates."""
    from megaframe.backends.registry import validate_for_engine

    args = ["recipe=llama3_8b_128k", "parallel.cp=1", "parallel.dp=64", "parallel.global_batch_size=64",
            "parallel.cp_impl=ulysses" if core == "ulysses" else "model.attention_core=flex"]
    cfg, _ = compose(args)
    base = plan_layout(cfg, validate(cfg, planned_world_size(cfg), fp16_supported=lambda: False,
                                     engine_problem=DEEPSPEED_RULES))
    proposals = [e.layout for e in fitting_layouts(cfg, base, limit=10_000)]
    cps = {lay.cp for lay in proposals}
    assert proposals and (cps == {1} if core == "flex" else 1 < max(cps) and all(8 % cp == 0 for cp in cps))
    for lay in proposals[::25]:
        validate_for_engine(compose([*args, *layout_overrides(lay)])[0], 64, ask_bf16=False)


def test_parallel_auto_searches_a_world_the_recipes_layout_does_not_divide(capsys):
    """llama2_70b's tp=8 pp=4 on two nodes of 8: parallel=auto refused before it searched ("world
    size 16 is not divisible by 32"), where planner.md says to fix the nodes and add parallel=auto."""
    from megaframe.plan.cli import main as plan_main

    overrides = ["recipe=llama2_70b", "cluster=h100_80g", "launcher.nodes=2", "parallel.dp=null"]
    plan_main([*overrides, "parallel=auto", "--json"])
    out, err = capsys.readouterr()
    chosen = json.loads(out)["auto"]
    grid = chosen["layout"]["grid"]
    assert chosen["fits"] and chosen["world_size"] == grid["tp"] * grid["pp"] * grid["dp"] == 16, chosen
    assert err.strip().splitlines()[0] == (
        "megaframe-plan: parallel=auto: the layout given (tp=8 pp=4 cp=1 ep=1) cannot run on 16 ranks (world size "
        "16 is not divisible by parallel.tp*parallel.pp=32); the search starts from tp=1 pp=1 dp=16")
    with pytest.raises(SystemExit) as ended:  # without parallel=auto the layout given is what runs
        plan_main(overrides)
    assert ended.value.code == 2
    assert "world size 16 is not divisible by parallel.tp*parallel.pp=32" in capsys.readouterr().err


def test_the_pre_launch_check_starts_parallel_auto_from_a_layout_the_world_runs(monkeypatch, capsys):
    """megaframe-train's path (launch/checks.py): a launcher's world of 2 ranks and tp=4 asked."""
    from megaframe.launch.checks import check

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.ffn_hidden_size=256", "model.seq_length=32", "parallel.micro_batch_size=2",
            "parallel.global_batch_size=8", "parallel.tp=4", "parallel.dp=null"]
    cfg, layout, _ = check([*tiny, "parallel=auto"])
    assert (cfg.parallel.tp, layout.dp, layout.world_size) == (1, 2, 2)
    assert "the search starts from tp=1 pp=1 dp=2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ended:
        check(tiny)
    assert ended.value.code == 2


def test_parallel_auto_with_muon_starts_from_zero_1_where_zero_0_is_refused(monkeypatch, capsys):
    """optim=muon at dp=2 under DeepSpeed refuses ZeRO-0; parallel=auto checked the stage given before
    its search (which picks the stage) and refused with exit 2 (feature review)."""
    from megaframe.launch.checks import check

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
            "model.seq_length=32", "parallel.micro_batch_size=2", "parallel.global_batch_size=8", "parallel.dp=null",
            "optim=muon"]
    cfg, layout, _ = check([*tiny, "parallel=auto"])
    assert layout.dp == 2 and cfg.zero.stage >= 1
    assert "the search starts from tp=1 pp=1 dp=2 zero=1" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ended:
        check(tiny)
    assert ended.value.code == 2


def test_parallel_auto_from_a_start_keeps_hsdp_replicas_and_hands_them_to_the_ranks(monkeypatch, capsys):
    """The start set dp_replicate=1 and layout_overrides left it out: the ranks ran the configured
    replicas on a layout planned without them (review)."""
    from megaframe.launch.checks import check

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.ffn_hidden_size=256", "model.seq_length=32", "parallel.micro_batch_size=2",
            "parallel.global_batch_size=16", "backend=fsdp2", "parallel.dp_replicate=2", "parallel.tp=3",
            "parallel.dp=null", "parallel=auto"]
    cfg, layout, _ = check(tiny)
    assert (cfg.parallel.tp, layout.grid.dp_replicate, layout.dp) == (1, 2, 8)
    chosen = fitting_layouts(cfg, plan_layout(cfg, layout), limit=1)[0].layout
    assert chosen.grid.dp_replicate == 2 and "parallel.dp_replicate=2" in layout_overrides(chosen)
