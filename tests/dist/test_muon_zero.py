"""Muon under DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 (backends/deepspeed/muon_zero.py), two gloo ranks:
matrices cut anywhere by flat partitions (mid-row, whole on one rank, empty on one) take
torch.optim.Muon's step on the whole matrix within 1e-6, each rank assembling only the matrices it
owns; then the real engine at each stage trains the single-rank Muon curve, each rank running
Newton-Schulz on about half the matrices, as do ZeRO-1 and ZeRO-3 at tp=2 dp=2 (each matrix assembled
once over tp x dp from ZeRO's ranges of its TP pieces) and ZeRO-1 at pp=2 dp=2, and ZeRO-1
checkpoints at dp=2 and at tp=2 dp=2 resume at FSDP2 dp=2 on the curve."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.composed import composed, composes_runs
from tests.support.helpers import TINY, curve, read_metrics
from tests.support.muon_oracle import TorchMuon
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

TP2DP2 = ["parallel.tp=2", "parallel.dp=2"]
ONE_KV = ["model.num_kv_heads=1"]  # fewer kv heads than tp: k and v whole on each TP rank
SMALL_BUCKET_KEY, SMALL_BUCKET = "optim.muon.exchange_bucket_size", 20_000  # TINY's matrices: 4,096 and 16,384
SHAPES = [(5, 3), (4, 6), (1, 8), (6, 6), (7, 2), (2, 3, 4)]  # tall, wide, one row, square, an expert stack


BUCKET = 40  # the most elements of whole matrices one rank assembles per exchange: SHAPES' 121 in two buckets


def _flat_against_torch(rank: int, world: int) -> dict:
    """For one exchange (bucket 0) and for buckets of BUCKET: _flat_in_buckets."""
    return {bucket: _flat_in_buckets(rank, world, bucket) for bucket in (0, BUCKET)}


def _flat_in_buckets(rank: int, world: int, bucket: int) -> dict:
    """One flat buffer of SHAPES (one element of padding between parameters, as DeepSpeed's
    alignment leaves, and at the end), cut into two equal partitions as ZeRO-1/2 cut it."""
    import torch.distributed as dist

    from megaframe.backends.deepspeed.muon_zero import flat_part, flat_partition
    from megaframe.optim.muon import Muon

    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(*shape, generator=generator) for shape in SHAPES]
    offsets, at = [], 0
    for t in full:
        offsets.append(at)
        at += t.numel() + 1
    size = -(-at // world)  # each rank's partition
    flat_all = torch.zeros(size * world)

    def scatter(tensors):  # the whole flat buffer of these tensors, and this rank's partition of it
        buffer = flat_all.clone()
        for o, t in zip(offsets, tensors):
            buffer[o: o + t.numel()] = t.reshape(-1)
        return buffer[rank * size: (rank + 1) * size].clone()

    ranges = [[flat_part(o, t.numel(), r, size) for r in range(world)] for o, t in zip(offsets, full)]
    local = [o + parts[rank][0] - rank * size for o, parts in zip(offsets, ranges)]
    partition = flat_partition(SHAPES, ranges, local, dist.group.WORLD, rank, bucket_elements=bucket)
    flat = torch.nn.Parameter(scatter(full))
    holder = torch.nn.Parameter(torch.zeros(2, 2))  # the group holds a matrix until the engine swaps in its flat
    groups = [{"params": [holder], "optimizer": "muon", "lr": 0.02, "weight_decay": 0.1},
              {"params": [], "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0}]
    optimizer = Muon(groups, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5,
                     eps=1e-7, adjust_lr="spectral", betas=(0.9, 0.95), adamw_eps=1e-8)
    optimizer.param_groups[0]["params"] = [flat]  # as DeepSpeed does
    optimizer.partition_flat(flat, [partition])
    torch_muon = TorchMuon(full)
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=generator) for t in full]  # the same on both ranks
        flat.grad = scatter(grads)
        optimizer.step()
        torch_muon.step(grads)
    whole = [t.clone() for t in full]
    gathered = [torch.zeros(size) for _ in range(world)]
    dist.all_gather(gathered, flat.detach())
    buffer = torch.cat(gathered)
    gaps = [(buffer[o: o + t.numel()].view(t.shape) - ref).abs().max().item()
            for o, t, ref in zip(offsets, whole, torch_muon.tensors())]
    padding = [buffer[o + t.numel()].item() for o, t in zip(offsets, whole)]
    matrices = partition.matrices
    owned = matrices.owned()
    return {"gaps": gaps, "padding": padding, "owned": owned, "received": matrices.received_numel,
            "largest": matrices.largest_received, "owned_numel": sum(math.prod(SHAPES[i]) for i in owned),
            "wire": matrices.wire_dtype}


def test_flat_partitioned_muon_is_torch_muon_on_the_whole_matrix(tmp_path):
    """In one exchange and in buckets of at most BUCKET elements per owner (each bucket's Nesterov updates
    made from the partition's moved momentum), exchanged in bf16: torch's step; in buckets no exchange
    receives more than one."""
    by_rank = run_ranks(_flat_against_torch, 2, tmp_path)
    assert {r[b]["wire"] for r in by_rank for b in (0, BUCKET)} == {torch.bfloat16}, by_rank
    for bucket in (0, BUCKET):
        results = [r[bucket] for r in by_rank]
        for rank, result in enumerate(results):
            assert max(result["gaps"]) <= 1e-6, (bucket, rank, result["gaps"])
            assert result["padding"] == [0.0] * len(SHAPES), (bucket, rank, result["padding"])  # never stepped
            # no rank assembles a matrix it does not own: what it received is exactly its own matrices
            assert result["received"] == result["owned_numel"] > 0, (bucket, rank, result)
        owners = [set(r["owned"]) for r in results]
        assert owners[0].isdisjoint(owners[1]) and owners[0] | owners[1] == set(range(len(SHAPES)))
    assert max(r[BUCKET]["largest"] for r in by_rank) <= BUCKET < max(r[0]["largest"] for r in by_rank), by_rank


@composes_runs
def _train_counting(rank: int, world: int, runs: list[tuple[list[str], str]]) -> list[dict]:
    """Train each run in these ranks (as tests/support/parity.train_runs does) and return, per run,
    what this rank's Muon assembled: its matrices' ownership and the elements it received."""
    import torch.distributed as dist

    from megaframe.backends.registry import validate_for_engine
    from megaframe.optim.groups import is_hidden_matrix
    from megaframe.optim.owners import ns_cost
    from megaframe.training.trainer import Trainer

    out = []
    for overrides, run_dir in runs:
        cfg = composed(overrides)  # composed once before the ranks were forked
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
            trainer.fit()
            engine = getattr(trainer.backend, "engine", None)  # DeepSpeed's (FSDP2's: none)
            muon = getattr(engine.optimizer, "optimizer", None) if engine is not None else None
            partitions = [part for parts in getattr(muon, "flat_partitions", {}).values() for part in parts]
            # Muon's momentum and AdamW's moments, each storage once: what the memory report must count
            state = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for st in (muon.state.values()
                     if muon is not None else ()) for v in st.values() if torch.is_tensor(v) and v.dim() > 0}
            hidden = [p for name, p in trainer.backend.module.named_parameters()
                      if is_hidden_matrix(name, tuple(getattr(p, "ds_shape", p.shape)))]
            # the groups of ranks assembling them (tp x dp, and dp for a matrix whole on every TP rank)
            groups = {tuple(dist.get_process_group_ranks(p.matrices.group)) for p in partitions}
            out.append({"engine": trainer.engine, "partitions": len(partitions), "hidden": len(hidden),
                        "groups": len(groups),
                        "not_tp_split": sum(getattr(p, "partition_count", 1) == 1 for p in hidden),
                        "state_bytes": sum(state.values()),
                        "held_optimizer": trainer.backend.held_model_states()["optimizer"] if muon else 0,
                        "matrices": sum(len(p.matrices.shapes) for p in partitions),
                        "owned": sum(len(p.matrices.owned()) for p in partitions),
                        "received": sum(p.matrices.received_numel for p in partitions),
                        "largest": max((p.matrices.largest_received for p in partitions), default=0),
                        "buckets": sum(len(p.matrices.buckets) for p in partitions),
                        "owned_numel": sum(math.prod(p.matrices.shapes[i]) for p in partitions for i in p.matrices.owned()),
                        "owned_cost": sum(ns_cost(p.matrices.shapes[i]) for p in partitions for i in p.matrices.owned()),
                        "cost": sum(ns_cost(s) for p in partitions for s in p.matrices.shapes)})
    return out


def _planned_cost(overrides: list[str]) -> int:
    """The Newton-Schulz work the planner's assembled matrices (plan/optimizer.py) put on all the ranks
    of a layout together, in optim/sharded.py's ns_cost units: each TP-split matrix once, each
    matrix whole on every TP rank once per TP rank."""
    from megaframe.config.compose import compose
    from megaframe.model.factory import resolve_dims
    from megaframe.plan.optimizer import assembled_matrices

    cfg, _ = compose(overrides)
    dims, tp = resolve_dims(cfg.model, 256), cfg.parallel.tp
    moe_blocks = dims.num_moe_blocks
    return sum(a.count * a.stack * a.rows * a.cols * min(a.rows, a.cols) * (tp if a.axis == "whole" else 1)
               for a in assembled_matrices(dims, dims.num_layers - moe_blocks, moe_blocks, tp))


def test_zero_stages_at_two_ranks_train_the_single_rank_muon_curve_and_resume_at_fsdp2(tmp_path):
    """ZeRO-1, ZeRO-2 and ZeRO-3 at dp=2, ZeRO-1 (with sequence parallelism) and ZeRO-3 (with one kv
    head: k and v whole on both TP ranks, assembled over dp in a group of their own beside tp x dp's)
    at tp=2 dp=2 (exchanged in buckets of 20,000 elements), ZeRO-1 at pp=2 dp=2, at cp=2, and ZeRO-1
    and ZeRO-3 at ep=2 dp=2 (MoE) follow the one-rank Muon curve (fp32; bf16 at ZeRO-3, whose flat
    fp32 masters DeepSpeed rounds to bf16 weights, against one bf16 rank; a MoE model's expert
    stacks), each rank assembling only the matrices it owns (about half the Newton-Schulz work; under tp
    and pp all ranks together the work the planner puts on them). The
    ZeRO-1 run's step-3 layout-free checkpoint (Muon's momentum by name) resumes at FSDP2 dp=2 and at
    ZeRO-3 and continues the curve, and so does the tp=2 dp=2 ZeRO-1 run's at FSDP2 dp=2 (each TP
    piece's momentum, cut by ZeRO, by name); so does ZeRO-2's native one (DeepSpeed's files) at ZeRO-2."""
    base = [*TINY, "optim=muon", "train.max_steps=6"]
    bf16 = [*base, "precision=bf16"]
    moe = [*base, "model=moe_tiny", "train.max_steps=4"]
    # the fp32 reference: FSDP2's one-rank run, which test_muon_layouts.py's cached reference shares
    one = reference_runs({"dense": [*base, "backend=fsdp2"]}, tmp_path / "one")["dense"]
    run_ranks(train_runs, 1, tmp_path, runs=[([*bf16, "zero=stage1"], str(tmp_path / "one_bf16")),
                                             ([*base, *ONE_KV], str(tmp_path / "one_kv")),
                                             (moe, str(tmp_path / "one_moe"))])
    stages = ("stage1", "stage2", "stage3")
    saved = tmp_path / "stage1" / "checkpoints" / "global_step3"
    saves = {"stage1": ["train.save_interval=3"],  # layout-free
             "stage2": ["train.save_interval=3", "train.universal_checkpoint=false", "train.native_checkpoint=true"]}
    runs = [([*base, "parallel.dp=2", f"zero={s}", *saves.get(s, [])], str(tmp_path / s)) for s in stages]
    runs.append(([*bf16, "parallel.dp=2", "zero=stage3"], str(tmp_path / "stage3_bf16")))
    runs.append(([*moe, "parallel.dp=2", "zero=stage3"], str(tmp_path / "stage3_moe")))  # expert stacks too
    # four ranks: tensor parallelism (ZeRO's ranges of TP pieces, assembled over tp x dp) and the pipeline
    tp_saved = tmp_path / "tp2dp2_stage1" / "checkpoints" / "global_step3"
    four = {"tp2dp2_stage1": [*TP2DP2, "parallel.sequence_parallel=true", "zero=stage1", "train.save_interval=3"],
            # and in buckets of at most 20,000 elements of whole matrices per owner (several per group)
            "tp2dp2_stage3": [*TP2DP2, *ONE_KV, "zero=stage3", f"{SMALL_BUCKET_KEY}={SMALL_BUCKET}"],
            "pp2dp2_stage1": ["parallel.pp=2", "parallel.dp=2", "zero=stage1"]}
    on_four = run_ranks(_train_counting, 4, tmp_path, runs=[([*base, *extra], str(tmp_path / name))
                                                             for name, extra in four.items()])
    runs.append(([*base, "parallel.dp=2", "backend=fsdp2", f"train.resume={tp_saved}"], str(tmp_path / "tp_resumed")))
    runs.append(([*base, "parallel.dp=2", "backend=fsdp2", f"train.resume={saved}"], str(tmp_path / "resumed")))
    runs.append(([*base, "parallel.dp=2", "zero=stage3", f"train.resume={saved}"], str(tmp_path / "resumed_zero3")))
    native = tmp_path / "stage2" / "checkpoints" / "global_step3"  # DeepSpeed's own files: Muon's state_dict
    runs.append(([*base, "parallel.dp=2", "zero=stage2", "train.universal_checkpoint=false",
                  "train.native_checkpoint=true", "train.trust_pickled_checkpoint=true", f"train.resume={native}"],
                 str(tmp_path / "resumed_native")))
    # context parallelism (ZeRO over dp x cp: the same group assembles) and expert parallelism (each
    # rank's experts whole, ZeRO over their expert-data-parallel ranks)
    other_axes = {"cp2_stage1": [*base, "parallel.cp=2", "zero=stage1"],
                  "ep2_stage1_moe": [*moe, "parallel.dp=2", "parallel.ep=2", "zero=stage1"],
                  "ep2_stage3_moe": [*moe, "parallel.dp=2", "parallel.ep=2", "zero=stage3"]}
    runs += [(overrides, str(tmp_path / name)) for name, overrides in other_axes.items()]
    ranks = run_ranks(_train_counting, 2, tmp_path, runs=runs)
    reference = {name: curve(read_metrics(tmp_path / name), "loss") for name in ("one_bf16", "one_moe", "one_kv")}
    reference["one"] = curve(read_metrics(one), "loss")
    assert [s for s, _ in reference["one"]] == [s for s, _ in reference["one_bf16"]] == list(range(1, 7))
    # (run, its reference, first step, relative tolerance: bf16 rounds each rank's weights alike, its
    # reductions not)
    for name, against, start, rel in [*((s, "one_kv" if ONE_KV[0] in four.get(s, ()) else "one", 0, 1e-4)
                                        for s in (*stages, *four)), ("tp_resumed", "one", 3, 1e-4),
                                      ("stage3_bf16", "one_bf16", 0, 1e-3),
                                      ("stage3_moe", "one_moe", 0, 1e-4), ("resumed", "one", 3, 1e-4),
                                      ("resumed_zero3", "one", 3, 1e-4), ("resumed_native", "one", 3, 1e-4),
                                      ("cp2_stage1", "one", 0, 1e-4), ("ep2_stage1_moe", "one_moe", 0, 1e-4),
                                      ("ep2_stage3_moe", "one_moe", 0, 1e-4)]:
        got = curve(read_metrics(tmp_path / name), "loss")
        assert [s for s, _ in got] == list(range(start + 1, len(reference[against]) + 1)) != [], name
        for (step, a), (_, b) in zip(got, reference[against][start:]):
            assert a == pytest.approx(b, rel=rel), f"{name} at step {step}: {a} vs one rank's {b}"
    for k, stage in enumerate((*stages, "stage3_bf16", "stage3_moe")):
        counts = [r[k] for r in ranks]
        assert all(c["engine"] == "deepspeed" and c["partitions"] >= 1 for c in counts), (stage, counts)
        # every hidden matrix located in the partitions, each assembled on exactly one rank, only
        # there, and the Newton-Schulz work about halved
        hidden = counts[0]["hidden"]
        assert hidden >= 6 and counts[0]["matrices"] == counts[1]["matrices"] == hidden, (stage, counts)
        assert counts[0]["owned"] + counts[1]["owned"] == hidden, (stage, counts)
        assert sum(c["owned_cost"] for c in counts) == _planned_cost(moe if stage == "stage3_moe" else base), stage
        for c in counts:
            assert c["received"] == c["owned_numel"] > 0, (stage, c)
            assert 0.3 <= c["owned_cost"] / c["cost"] <= 0.7, (stage, c)
    names = [Path(run_dir).name for _, run_dir in runs]
    for name, overrides in other_axes.items():
        counts = [r[names.index(name)] for r in ranks]
        assert all(c["engine"] == "deepspeed" and c["partitions"] >= 1 for c in counts), (name, counts)
        # each matrix assembled once: over the pair at cp (ZeRO's dp x cp group), each rank's own
        # experts by itself at ep (their expert-data-parallel group is that rank), the rest over dp
        assert sum(c["owned_cost"] for c in counts) == _planned_cost(overrides), (name, counts)
        for c in counts:
            assert c["received"] == c["owned_numel"] > 0, (name, c)
    for k, name in enumerate(four):
        counts = [r[k] for r in on_four]
        assert all(c["engine"] == "deepspeed" and c["matrices"] == c["hidden"] >= 3 for c in counts), (name, counts)
        # under tp each TP-split matrix is assembled once over the four ranks of tp x dp (not once per
        # TP piece over dp: twice as many), a matrix whole on both TP ranks (k and v at one kv head)
        # once per dp pair, in its own group; pp's stages each assemble their own over their dp pair
        tp = name.startswith("tp")
        once = counts[0]["hidden"] + counts[0]["not_tp_split"] if tp else sum(c["hidden"] for c in counts) // 2
        assert sum(c["owned"] for c in counts) == once, (name, counts)
        whole_on_tp = ONE_KV[0] in four[name]
        for c in counts if tp else ():
            assert c["groups"] == 1 + whole_on_tp and (c["not_tp_split"] > 0) == whole_on_tp, (name, c)
        # the planner's matrices as assembled (full shapes; whole on every TP rank where tp does not
        # divide the kv heads) are the Newton-Schulz work these ranks ran, in ns_cost's units
        assert sum(c["owned_cost"] for c in counts) == _planned_cost([*base, *four[name]]), (name, counts)
        for c in counts:
            assert c["received"] == c["owned_numel"] > 0, (name, c)
            if SMALL_BUCKET_KEY in " ".join(four[name]):  # no exchange received more than a bucket
                assert c["buckets"] > c["groups"] and 0 < c["largest"] <= SMALL_BUCKET, (name, c)
            # the memory report counts Muon's state as optimizer state (bf16: with the fp32 masters)
            assert c["state_bytes"] > 0 and (c["held_optimizer"] == c["state_bytes"] if "bf16" not in stage
                                             else c["held_optimizer"] > c["state_bytes"]), (stage, c)
