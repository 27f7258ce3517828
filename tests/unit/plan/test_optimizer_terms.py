"""The planner's Muon terms against what megaframe's Muon does: the matrices its parameter groups
give Muon, the state tensors the optimizer really allocates, the Newton-Schulz FLOPs torch counts in
orthogonalise itself, and the rows optim/sharded.py sends to each matrix's owner and back."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaframe.config.compose import compose
from megaframe.config.schema import ModelConfig, MoEConfig, OptimConfig
from megaframe.model.factory import resolve_dims
from megaframe.model.gpt import GPT
from megaframe.optim.build import build_optimizer
from megaframe.optim.groups import muon_param_groups
from megaframe.optim.muon import EXCHANGE_DTYPE, orthogonalise
from megaframe.optim.owners import assign_owners, bucket_owners
from megaframe.parallel.dims import ParallelDims
from megaframe.plan.cli import plan, planned_world_size
from megaframe.plan.estimate import estimate_stage
from megaframe.plan.memory import PlanLayout, stage_block_kinds
from megaframe.plan.optimizer import (assembled_matrices, assembly_bytes, busiest_rank_flops, exchange_order,
                                      matrix_parameters, newton_schulz_flops, optimizer_terms, stage_matrices)

LLAMA_MOE = dict(arch="llama", norm="rmsnorm", activation="swiglu", position_embedding="rope", tie_embeddings=False,
                 bias=False, num_kv_heads=2, moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=48, shared_experts=1,
                                                           first_dense_layers=1))
# model.moe.layer_freq=2 from block 0: routed, dense, routed (the dense blocks are not all first)
INTERLEAVED = {**LLAMA_MOE, "moe": MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=48, shared_experts=1, layer_freq=2)}
SHAPES = {"gpt2": {}, "llama_moe": LLAMA_MOE, "llama_moe_interleaved": INTERLEAVED}
WIRE = torch.empty(0, dtype=EXCHANGE_DTYPE).element_size()  # bytes per element optim/sharded.py sends for Muon


def _dims(flavour: str):
    cfg = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=96,
                      **SHAPES[flavour])
    return resolve_dims(cfg, 96)


def _muon() -> OptimConfig:
    return compose(["optim=muon"])[0].optim


@pytest.mark.parametrize("flavour", sorted(SHAPES))
def test_the_plans_matrices_are_the_ones_muons_groups_hold(flavour):
    """optim/groups.py decides by name and shape what Muon steps (projections, shared and routed
    experts; not embeddings, head, router, norms or biases): the planner counts the same tensors."""
    dims = _dims(flavour)
    groups = muon_param_groups(GPT(dims), _muon())
    held = sorted(tuple(p.shape[-2:]) for p in groups[0]["params"] for _ in range(p.shape[0] if p.ndim == 3 else 1))
    moe_blocks = dims.num_moe_blocks
    planned = sorted((r, c) for n, r, c in stage_matrices(dims, dims.num_layers - moe_blocks, moe_blocks)
                     for _ in range(n))
    assert planned == held
    assert matrix_parameters(stage_matrices(dims, dims.num_layers - moe_blocks, moe_blocks)) == \
        sum(p.numel() for p in groups[0]["params"])


@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (32, 32), (3, 24, 40)])
def test_newton_schulz_flops_are_what_torch_counts_in_orthogonalise(shape):
    """orthogonalise's matmuls (X Xᵀ, the Gram polynomial, its product with X; batched for a stack),
    counted by torch's FlopCounterMode: 2·(2·m²·n + m³) per iteration, m <= n."""
    steps = 5
    with FlopCounterMode(display=False) as counter:
        orthogonalise(torch.randn(shape), (3.4445, -4.775, 2.0315), steps, 1e-7)
    stack = shape[0] if len(shape) == 3 else 1
    assert counter.get_total_flops() == stack * newton_schulz_flops(*shape[-2:], steps)


def test_planned_optimizer_state_is_what_muon_allocates():
    """One process in fp32 (Muon's plain-engine layout): the bytes of every state tensor the real
    optimizer holds after a step (Muon's momentum buffer on its matrices, AdamW's two moments on
    the rest; scalar step counts aside) are the planner's optimizer bytes; AdamW's would be more."""
    dims = _dims("llama_moe")
    model = GPT(dims)
    optimizer = build_optimizer(model, _muon(), fused=False)
    model(torch.randint(0, 96, (2, 32)), torch.randint(0, 96, (2, 32))).backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.ndim > 0)
    lay = PlanLayout(grid=ParallelDims(), micro_batch_size=2, global_batch_size=2)
    muon = estimate_stage(dims, lay, "fp32", 0, 0.0, False, optim=optimizer_terms(_muon()))
    adamw = estimate_stage(dims, lay, "fp32", 0, 0.0, False)
    assert muon.states.optimizer == held
    assert adamw.states.optimizer - muon.states.optimizer == 4 * sum(p.numel() for p in muon_param_groups(model, _muon())[0]["params"])


@pytest.mark.parametrize("ranks", [2, 4])
def test_assembly_traffic_is_the_rows_sent_to_owners_and_back(ranks):
    """optim/sharded.py's exchanges, rebuilt from its own owner assignment and row split: every rank
    sends its rows of each matrix it does not own, in Muon's exchange dtype (bf16), and gets them back
    orthogonalised. The planner's per-rank figure is their mean over the ranks."""
    dims = _dims("gpt2")
    shapes = [(r, c) for n, r, c in stage_matrices(dims, dims.num_layers, 0) for _ in range(n)]
    owners = assign_owners(shapes, ranks)
    sent = [0] * ranks
    for (rows, cols), owner in zip(shapes, owners):
        split = [len(chunk) for chunk in torch.arange(rows).chunk(ranks)]  # FSDP2's Shard(0): torch.chunk's rows
        for rank, count in enumerate(split + [0] * (ranks - len(split))):
            sent[rank] += 0 if rank == owner else 2 * WIRE * count * cols  # there, and its result back
    total = sum(r * c for r, c in shapes)
    assert assembly_bytes(total, ranks) == pytest.approx(sum(sent) / ranks, rel=0.02)


def test_a_muon_plan_counts_state_newton_schulz_and_assembly():
    """llama2_7b on 8 H100s under FSDP2: against AdamW, Muon's plan holds 4 bytes less per matrix
    parameter (over the 8 shards), adds its Newton-Schulz FLOPs (1/8 of the model's matrices' on
    each rank: torch's count of orthogonalise on one block's matrices, times the blocks) at the bf16
    peak and the plan's MFU, and sends the assembly traffic."""
    keys = ["recipe=llama2_7b", "cluster=h100_80g", "backend=fsdp2", "zero=stage3", "parallel.dp=8", "launcher.nodes=1"]
    results = {}
    for name in ("adamw", "muon"):
        cfg, _ = compose([*keys, f"optim={name}"])
        results[name] = plan(cfg, planned_world_size(cfg))[1]
    adamw, muon = results["adamw"], results["muon"]
    dims = resolve_dims(cfg.model, 32000)
    block = stage_matrices(dims, 1, 0)
    with FlopCounterMode(display=False) as counter:  # the small ones of a block, counted by torch
        for n, r, c in block:
            for _ in range(n):
                orthogonalise(torch.randn(min(r, c) // 16, max(r, c) // 16), (3.4445, -4.775, 2.0315), 5, 1e-7)
    # Newton-Schulz is cubic: 1/16 of each side is 1/4096 of the FLOPs. In one exchange the 32 blocks'
    # matrices share out evenly over the 8 ranks (costliest first); in the default buckets (at most 10^9
    # elements per owner: here all of them in one) the same; in buckets of 5·10^7 per owner, several
    # exchanges one after the other, each waiting for its busiest owner: more
    balanced = counter.get_total_flops() * 16 ** 3 * dims.num_layers / 8
    cfg_one, _ = compose([*keys, "optim=muon", "optim.muon.exchange_bucket_size=0"])
    assert plan(cfg_one, planned_world_size(cfg_one))[1].optimizer_flops_per_rank == pytest.approx(balanced)
    assert muon.optimizer_flops_per_rank == pytest.approx(balanced)
    cfg_small, _ = compose([*keys, "optim=muon", "optim.muon.exchange_bucket_size=50000000"])
    assert plan(cfg_small, planned_world_size(cfg_small))[1].optimizer_flops_per_rank > 1.02 * balanced
    assert muon.step_time_s - adamw.step_time_s == pytest.approx(muon.optimizer_flops_per_rank / (989e12 * cfg.plan.mfu))
    matrices = matrix_parameters(block) * dims.num_layers
    assert adamw.stages[0].states.optimizer - muon.stages[0].states.optimizer == pytest.approx(4 * matrices / 8)
    assert muon.comm_bytes["optimizer"] == pytest.approx(assembly_bytes(matrices, 8)) and "optimizer" not in adamw.comm_bytes
    # the step's transient: a rank's share of a bucket's matrices (Nesterov's fp32 updates, the bf16 pieces
    # sent), the bf16 pieces of those it owns there, and the largest matrix's Newton-Schulz working set (in
    # bf16: the matrix, two iterates, the Gram matrix and polynomial). In one exchange (0) the share is an
    # eighth of every matrix and some owner assembles at least an eighth of them; in buckets of B elements
    # per owner (10^9, the default; 5·10^7) a bucket holds at most 8 B (no matrix is larger than B), an
    # eighth of which is the share, and an owner assembles at most B
    h, f = dims.hidden_size, dims.ffn_hidden_size
    iterating = WIRE * (f * h + 2 * f * h + 2 * h * h)
    default = cfg.optim.muon.exchange_bucket_size
    cfg, _ = compose([*keys, "optim=muon", "optim.muon.exchange_bucket_size=0"])
    one = plan(cfg, planned_world_size(cfg))[1].stages[0].step_working
    assert one >= (4 + WIRE) * matrices / 8 + WIRE * matrices / 8 + iterating
    for bucket in (default, 5 * 10 ** 7):
        cfg, _ = compose([*keys, "optim=muon", f"optim.muon.exchange_bucket_size={bucket}"])
        assert iterating < plan(cfg, planned_world_size(cfg))[1].stages[0].step_working \
            <= (4 + WIRE) * bucket + WIRE * bucket + iterating, bucket


def _full_matrices(overrides: list[str]):
    """(name, rows, cols, stack) of every matrix Muon steps, at their full (TP-unsplit) shapes, from the
    model built on the meta device, and the composed config."""
    cfg, _ = compose(overrides)
    dims = resolve_dims(cfg.model, cfg.model.vocab_size or 256)
    with torch.device("meta"):
        model = GPT(dims)
    names = {id(p): n for n, p in model.named_parameters()}
    held = [(names[id(p)], *p.shape[-2:], p.shape[0] if p.ndim == 3 else 1)
            for p in muon_param_groups(model, cfg.optim)[0]["params"]]
    return cfg, held


def _ns(rows: int, cols: int, stack: int, steps: int) -> float:
    m, n = min(rows, cols), max(rows, cols)
    return stack * steps * 2.0 * (2 * m * m * n + m ** 3)


def _per_rank(matrices, steps: int, ranks: int, bucket: int) -> float:
    """The busiest rank's Newton-Schulz FLOPs when the optimizer's own buckets and owners (optim/owners.py)
    share these whole matrices (in the parameters' order) over `ranks`: each bucket's busiest owner, summed."""
    runs, owners = bucket_owners([(s, r, c) if s > 1 else (r, c) for _, r, c, s in matrices], ranks, bucket)
    busiest = 0.0
    for members in runs:
        load: dict[int, float] = {}
        for i in members:
            _, r, c, s = matrices[i]
            load[owners[i]] = load.get(owners[i], 0.0) + _ns(r, c, s, steps)
        busiest += max(load.values())
    return busiest


@pytest.mark.parametrize("layout", [["parallel.dp=4"], ["parallel.dp=2", "parallel.tp=2"],
                                    ["parallel.dp=2", "parallel.tp=2", "model.num_kv_heads=1"]])
@pytest.mark.parametrize("engine", [["backend=deepspeed", "zero=stage1"], ["backend=fsdp2", "zero=stage3"]])
def test_newton_schulz_is_shared_where_the_optimizer_is_partitioned(engine, layout):
    """Under ZeRO-1/2 (not only ZeRO-3) and FSDP2, each matrix has one owner among the ranks holding its
    parts: a TP-split matrix is orthogonalised whole once over tp x dp, one every TP rank holds whole
    (k and v where tp does not divide the kv heads) once per TP rank over dp; so the busiest rank runs
    the model's full-matrix Newton-Schulz FLOPs over those ranks (not TP-local shapes over dp, nor all
    of them at ZeRO-1/2), and sends its parts to their owners and back."""
    cfg, held = _full_matrices(["model=llama_tiny", "optim=muon", "parallel.micro_batch_size=1", *engine, *layout])
    est = plan(cfg, planned_world_size(cfg))[1]
    tp, dp, steps = cfg.parallel.tp, cfg.parallel.dp, cfg.optim.muon.ns_steps
    whole = [m for m in held if tp > 1 and cfg.model.num_kv_heads % tp and m[0].endswith(("k_proj.weight", "v_proj.weight"))]
    split = [m for m in held if m not in whole]
    bucket = cfg.optim.muon.exchange_bucket_size
    assert est.optimizer_flops_per_rank == pytest.approx(_per_rank(split, steps, tp * dp, bucket)
                                                         + _per_rank(whole, steps, dp, bucket))
    if layout == ["parallel.dp=4"]:  # a quarter of the one-rank plan's work
        one, _ = compose(["model=llama_tiny", "optim=muon", "parallel.micro_batch_size=1", *engine, "parallel.dp=1"])
        assert est.optimizer_flops_per_rank == pytest.approx(plan(one, 1)[1].optimizer_flops_per_rank / 4, rel=0.05)
    # each rank's part of each matrix (numel / ranks) there and its result back, but for the ones it owns
    sent = sum(2 * WIRE * r * c * s / n * (n - 1) / n for group, n in ((split, tp * dp), (whole, dp))
               for _, r, c, s in group)
    assert est.comm_bytes["optimizer"] == pytest.approx(sent)
    # an owner holds its largest matrix whole (assembled, iterates and Gram matrices in bf16) at the step
    largest = max(WIRE * r * c + 2 * (2 * r * c + 2 * min(r, c) ** 2) for _, r, c, _ in held)
    assert est.stages[0].step_working > largest


def test_zero_0_at_one_rank_shares_nothing():
    """One rank: every matrix is whole there, nothing is assembled, all Newton-Schulz work is its own."""
    cfg, held = _full_matrices(["model=llama_tiny", "optim=muon", "backend=deepspeed", "zero=stage0", "precision=fp32"])
    est = plan(cfg, 1)[1]
    assert est.optimizer_flops_per_rank == pytest.approx(sum(_ns(r, c, s, cfg.optim.muon.ns_steps) for _, r, c, s in held))
    assert "optimizer" not in est.comm_bytes


@pytest.mark.parametrize("flavour", sorted(SHAPES))
def test_the_plans_exchange_order_is_the_models_parameter_order(flavour):
    """The optimizer exchanges a group's matrices in the model's parameter order, a bucket of consecutive
    ones at a time: the planner lists each axis's matrices (full shapes, expert stacks whole) in that order."""
    dims = _dims(flavour)
    moe_blocks = dims.num_moe_blocks
    with torch.device("meta"):
        model = GPT(dims)
    held = [tuple(p.shape) for p in muon_param_groups(model, _muon())[0]["params"]]
    assembled = assembled_matrices(dims, dims.num_layers - moe_blocks, moe_blocks)
    kinds = stage_block_kinds(dims, 1, 1, 0)
    assert exchange_order(assembled, "tp", kinds) == [s for s in held if len(s) == 2]
    assert exchange_order(assembled, "experts", kinds) == [s for s in held if len(s) == 3]


def test_a_pipeline_stages_exchange_order_is_its_blocks_parameter_order():
    """Each pipeline stage holds a run of blocks, MoE and dense as model.moe.layer_freq interleaves them:
    the plan's order for a stage is the model's order over exactly those blocks."""
    dims = _dims("llama_moe_interleaved")  # routed, dense, routed
    with torch.device("meta"):
        blocks = GPT(dims).blocks
    groups = [muon_param_groups(blocks[i], _muon()) for i in range(dims.num_layers)]
    for pp, cuts in ((2, [[0, 1], [2]]), (3, [[0], [1], [2]])):  # uniform: the first num_layers % pp stages one more
        for stage, held_blocks in enumerate(cuts):
            kinds = stage_block_kinds(dims, 1, pp, stage)
            moe = sum(kind == "moe" for kind in kinds)
            assembled = assembled_matrices(dims, len(kinds) - moe, moe)
            held = [tuple(p.shape) for i in held_blocks for g in groups[i][:1] for p in g["params"]]
            assert len(kinds) == len(held_blocks)
            assert exchange_order(assembled, "tp", kinds) == [s for s in held if len(s) == 2]
            assert exchange_order(assembled, "experts", kinds) == [s for s in held if len(s) == 3]


@pytest.mark.parametrize("bucket", [0, 40_000, 200_000])
def test_interleaved_moe_blocks_are_bucketed_in_the_models_order(bucket):
    """moe_tiny with model.moe.layer_freq=2 (routed, dense, routed, dense) at dp=2: the plan's busiest-rank
    Newton-Schulz work is that of the real model's matrices, bucketed in their parameter order (listing
    the dense blocks first, as the plan once did, puts other matrices together at 40,000 and 200,000)."""
    cfg, _ = compose(["model=moe_tiny", "optim=muon", "model.moe.layer_freq=2", "parallel.dp=2", "zero=stage1",
                      "backend=deepspeed", f"optim.muon.exchange_bucket_size={bucket}"])
    with torch.device("meta"):
        model = GPT(resolve_dims(cfg.model, cfg.model.vocab_size or 256))
    held = [tuple(p.shape) for p in muon_param_groups(model, cfg.optim)[0]["params"]]
    steps = cfg.optim.muon.ns_steps
    real = sum(busiest_rank_flops([s for s in held if len(s) == dims], 2, steps, bucket) for dims in (2, 3))
    assert plan(cfg, 2)[1].optimizer_flops_per_rank == pytest.approx(real, rel=1e-12)


def test_each_exchange_waits_for_its_busiest_owner():
    """Per bucket, the busiest owner's Newton-Schulz work, summed over buckets (the bucket bounds what each
    owner assembles, optim/owners.py): eight equal matrices over eight ranks run one each, in one exchange
    or in buckets of one matrix per owner; over four ranks in buckets of one per owner, two exchanges
    one after the other; a bucket of one large matrix and three small ones waits for the large one."""
    one = newton_schulz_flops(64, 64, 5)
    assert busiest_rank_flops([(64, 64)] * 8, 8, 5, 0) == one
    assert busiest_rank_flops([(64, 64)] * 8, 8, 5, 64 * 64) == one  # every rank an owner in the bucket
    assert busiest_rank_flops([(64, 64)] * 8, 4, 5, 64 * 64) == 2 * one  # no room for a fifth: a second bucket
    assert busiest_rank_flops([(64, 64)] * 8, 4, 5, 2 * 64 * 64) == 2 * one  # one bucket, two each
    # 128 x 128 fills its owner's bucket of 128^2 elements; the three 64 x 64 share the other rank
    assert bucket_owners([(128, 128), (64, 64), (64, 64), (64, 64)], 2, 128 * 128) == ([[0, 1, 2, 3]], [0, 1, 1, 1])
    assert busiest_rank_flops([(128, 128), (64, 64), (64, 64), (64, 64)], 2, 5, 128 * 128) == \
        newton_schulz_flops(128, 128, 5)
    h, f = 4096, 11008
    blocks = [(h, h)] * 4 + [(f, h), (f, h), (h, f)]
    shapes = blocks * 32
    total = sum(newton_schulz_flops(*s, 5) for s in shapes)
    assert busiest_rank_flops(shapes, 8, 5, 0) == pytest.approx(total / 8)  # 32 of each shape: even
    # llama2_7b's blocks at dp=8 in buckets of 5·10^7 elements per owner (one or two matrices each): every
    # rank owns in every bucket, so the busiest rank stays near an eighth (a bound of 5·10^7 on each
    # bucket's total, one to three matrices a bucket, made it 6.5 x an eighth)
    assert busiest_rank_flops(shapes, 8, 5, 5 * 10 ** 7) < 1.5 * total / 8
