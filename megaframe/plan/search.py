"""Layout search: every legal (tp, pp, dp, ZeRO stage, offload, recomputation, SP) for a fixed world
size, estimated, those that fit ranked by estimated step time."""
from __future__ import annotations

from dataclasses import replace
from itertools import product
from typing import Callable, Iterator, Optional

from megaframe.backends.facts import EngineFacts
from megaframe.backends.registry import engine_facts, optim_refuses
from megaframe.config.attention_rules import core_problem, layout_problem as mask_layout_problem
from megaframe.config.fp8_rules import fp8_config_problem, kernel_shape_problem
from megaframe.config.schema import ModelConfig, TrainConfig
from megaframe.config.validate import _divisors  # O(sqrt(n)): 10**6 ranks
from megaframe.config.validate import ConfigError, Layout, check_context_parallel, ffn_hidden_size
from megaframe.model.dims import document_dims, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.pipeline_schedules import SPLIT_BACKWARD, runs_micro_batches, stages_per_rank
from megaframe.plan.estimate import Estimate, estimate, planning_device_type, planning_vocab_size
from megaframe.plan.host import checkpoint_copies
from megaframe.plan.memory import PlanLayout


LONG_SEQUENCE = 32768  # tokens: below this, cp only adds communication to what tp and dp do


def tensor_parallel_degrees(model: ModelConfig, world: int, gpus_per_node: int | None) -> list[int]:
    """tp that splits heads and MLP, divides the world and stays inside a node (TP across nodes is
    bandwidth-bound: Megatron keeps it within NVLink)."""
    limit = gpus_per_node or world
    ffn = ffn_hidden_size(model)
    return [t for t in _divisors(world) if t <= limit and model.num_attention_heads % t == 0 and ffn % t == 0]


def candidate_layouts(model: ModelConfig, base: PlanLayout, gpus_per_node: int | None) -> Iterator[PlanLayout]:
    """Every layout of base.world_size ranks that validation would accept, same batch sizes.

    The engine's facts (backends/facts.py) say which ZeRO stages it runs with and without a
    pipeline, at which stages parameters offload on their own, and which pipeline schedules it
    runs (DeepSpeed: ZeRO 0-1 in its 1F1B pipeline, parameter offload at ZeRO-3; FSDP2: ZeRO 2-3,
    CPU offload of everything or nothing, torch's schedules where the model has the blocks and the
    step the micro-batches they need). SP needs tp > 1 and a sequence divisible by tp. Context
    parallelism (ring) is tried for long sequences only."""
    world = base.world_size
    for tp in tensor_parallel_degrees(model, world, gpus_per_node):
        for cp in context_parallel_degrees(model, world // tp):
            yield from _with_tp_cp(model, base, tp, cp)


def context_parallel_degrees(model: ModelConfig, ranks: int) -> list[int]:
    """cp for `ranks` ranks: 1, and from LONG_SEQUENCE tokens on, every divisor up to 16 whose 2·cp
    chunks cut the sequence evenly."""
    if model.seq_length < LONG_SEQUENCE:
        return [1]
    return [c for c in _divisors(ranks) if c <= 16 and model.seq_length % (2 * c) == 0]


def _with_tp_cp(model: ModelConfig, base: PlanLayout, tp: int, cp: int) -> Iterator[PlanLayout]:
    world, replicas = base.world_size, base.grid.dp_replicate  # HSDP's replicas stay those configured
    facts = engine_facts(base.engine)
    for pp in _divisors(world // (tp * cp)):
        dp = world // (tp * cp * pp)
        if pp > model.num_layers or base.global_batch_size % (base.micro_batch_size * dp) or (dp * cp) % replicas:
            continue
        stages = facts.pipeline_zero_stages if pp > 1 else facts.zero_stages
        for ep, stage, (schedule, virtual) in product(expert_parallel_degrees(model, dp * cp), stages,
                                                       _schedules(model, base, pp, dp, facts)):
            if schedule in SPLIT_BACKWARD and stage not in facts.split_backward_zero_stages:
                continue
            offloads = [("none", "none")] + ([("cpu", "none")] if stage else []) + \
                ([("cpu", "cpu")] if stage in facts.param_offload_stages else [])
            for optimizer, param in offloads:
                for recompute in (False, True):
                    for sp in ((False, True) if tp > 1 and (model.seq_length // cp) % tp == 0 else (False,)):
                        yield replace(base, grid=ParallelDims(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, dp_replicate=replicas),
                                      zero_stage=stage,
                                      offload_optimizer=optimizer,
                                      offload_param=param, recompute=recompute, sequence_parallel=sp,
                                      pipeline_schedule=schedule, virtual_stages=virtual)


def _schedules(model: ModelConfig, base: PlanLayout, pp: int, dp: int, facts: EngineFacts) -> list[tuple[str, int]]:
    """The engine's pipeline schedules (facts.pipeline_schedules) this model and step can run."""
    if pp == 1:
        return [("1f1b", 1)]
    m = base.global_batch_size // (base.micro_batch_size * dp)
    return [(name, v) for name, v in facts.pipeline_schedules
            if pp * stages_per_rank(name, v) <= model.num_layers
            and (not facts.schedules_need_micro_batches or runs_micro_batches(name, pp, v, m))]


def expert_parallel_degrees(model: ModelConfig, replicas: int) -> list[int]:
    """ep for an MoE model whose dense layers have `replicas` (dp x cp) ranks: the divisors of the
    expert count that divide them (up to 64); 1 for a dense model."""
    experts = model.moe.num_experts
    if not experts:
        return [1]
    return [e for e in _divisors(replicas) if e <= 64 and experts % e == 0]


def fitting_layouts(cfg: TrainConfig, base: PlanLayout, limit: int = 10) -> list[Estimate]:
    """The fastest `limit` layouts of base.world_size ranks that fit cfg.cluster (fastest first;
    among equal times the one with more memory to spare)."""
    vocab, device = planning_vocab_size(cfg), planning_device_type(cfg)
    dims_for_tp: dict = {}
    fitting = []
    # plan.engines: each engine's own layouts (HSDP replicas are FSDP2's, kept only for the configured one)
    bases = [base if name == base.engine else replace(base, engine=name, grid=replace(base.grid, dp_replicate=1))
             for name in (cfg.plan.engines or [base.engine])]
    for lay in (lay for b in bases for lay in candidate_layouts(cfg.model, b, cfg.cluster.gpus_per_node)):
        if optim_refuses(cfg, lay) or attention_refuses(cfg, lay) or fp8_refuses(cfg, lay):  # validation's rules
            continue
        dims = dims_for_tp.setdefault(lay.tp, document_dims(resolve_dims(cfg.model, vocab, tp=lay.tp,
                                                                           device_type=device), cfg.data, None))
        est = estimate(dims, lay, cfg.precision.dtype, cfg.cluster, cfg.plan.mfu, zero=cfg.zero, tf32=cfg.precision.tf32,
                       fp8=cfg.precision.fp8, optim=cfg.optim, copies=checkpoint_copies(cfg))
        if est.fits:
            fitting.append(est)
    fitting.sort(key=lambda e: (round(e.ranked_step_time_s, 9), e.peak))
    return fitting[:limit]


def attention_refuses(cfg: TrainConfig, lay: PlanLayout) -> bool:
    """The attention rules validation applies, on a candidate's tp, pp, cp and core: Ulysses splits
    the heads cp ways (config/validate.py), the masks' layouts (no documents or windows across
    context-parallel pipeline stages, none under Ulysses: its dense mask) and the cores' (FlexAttention
    attends on one rank's tokens; config/attention_rules.py). So parallel=auto never proposes a cp
    layout the launch then refuses."""
    c = replace(cfg, parallel=replace(cfg.parallel, tp=lay.tp, pp=lay.pp, cp=lay.cp, cp_impl=lay.cp_impl,
                                      sequence_parallel=lay.sequence_parallel))
    return any(rule(c) is not None for rule in (check_context_parallel, mask_layout_problem, core_problem))


def fp8_refuses(cfg: TrainConfig, lay: PlanLayout) -> bool:
    """precision.fp8's widths on a candidate's tp (MXFP8's blocks of 32 along each local width): the
    search chose tp=2 where the MLP width / tp was 2000, and the launch then refused it (review)."""
    if not cfg.precision.fp8.enabled:
        return False
    c = replace(cfg, parallel=replace(cfg.parallel, tp=lay.tp, cp=lay.cp))
    width = ffn_hidden_size(c.model)
    on_gpus = planning_device_type(c) == "cuda"  # where the fp8 kernels' shapes bind (fp8_device_problem)
    return fp8_config_problem(c, width) is not None or (on_gpus and kernel_shape_problem(c, width) is not None)


def validated_to_search(cfg: TrainConfig, world: int, validate: Callable[[TrainConfig, int], Layout]
                        ) -> tuple[TrainConfig, Layout, Optional[str]]:
    """The layout to plan from: cfg's, validated for `world` ranks; under parallel=auto, when cfg's
    cannot run on them (a recipe's tp x pp that does not divide the world: llama2_70b's 32 on two
    nodes of 8), one that can, tp=pp=cp=ep=1 and dp=world, since the search replaces it anyway (the
    refusal came before any search), with a line that says so. The first error stands when neither
    validates."""
    try:
        return cfg, validate(cfg, world), None
    except ConfigError as error:
        if not cfg.parallel.auto:
            raise
        layout = None
        # HSDP's replicas as configured, if they fit; the ZeRO stage given, else stage 1, which the search
        # may pick anyway (optim=muon at dp=2 refuses ZeRO-0 under DeepSpeed: refused before any search)
        for replicas, stage in ((r, z) for r in dict.fromkeys((cfg.parallel.dp_replicate, 1))
                                for z in dict.fromkeys((cfg.zero.stage, 1))):
            start = replace(cfg, zero=replace(cfg.zero, stage=stage),
                            parallel=replace(cfg.parallel, tp=1, pp=1, cp=1, ep=1, dp=None, dp_replicate=replicas,
                                             sequence_parallel=False, pipeline_schedule="1f1b", virtual_stages=1))
            try:
                layout = validate(start, world)
                break
            except ConfigError:
                continue
        if layout is None:
            raise error
        p = cfg.parallel
        why = str(error).split(";")[0]  # its advice is for the layout given, which the search replaces
        given, stage = ("", "") if start.zero.stage == cfg.zero.stage else \
            (f" zero={cfg.zero.stage}", f" zero={start.zero.stage}")
        return start, layout, (f"parallel=auto: the layout given (tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep}{given}) "
                               f"cannot run on {world} ranks ({why}); the search starts from tp=1 pp=1 "
                               f"dp={layout.dp}{stage}")


def layout_overrides(lay: PlanLayout) -> list[str]:
    """Command-line overrides that select `lay` (what parallel=auto hands to the ranks)."""
    return [f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}", f"parallel.cp={lay.cp}", f"parallel.cp_impl={lay.cp_impl}",
            f"parallel.ep={lay.grid.ep}", f"parallel.dp_replicate={lay.grid.dp_replicate}",
            f"parallel.dp={lay.dp}", f"zero.stage={lay.zero_stage}",
            f"offload.optimizer={lay.offload_optimizer}", f"offload.param={lay.offload_param}",
            f"parallel.activation_checkpointing={str(lay.recompute).lower()}",
            f"parallel.sequence_parallel={str(lay.sequence_parallel).lower()}", f"backend.name={lay.engine}",
            f"parallel.pipeline_schedule={lay.pipeline_schedule}", f"parallel.virtual_stages={lay.virtual_stages}",
            "parallel.auto=false"]
