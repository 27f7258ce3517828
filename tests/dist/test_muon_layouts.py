"""Muon where tensor, pipeline, context, expert parallelism or HSDP split the model (optim/pieces.py,
optim/sharded.py), real gloo ranks.

At tp=2 x dp=2: column-parallel pieces (split by output rows) and row-parallel ones (by input
columns), each also split by rows over dp as FSDP2 splits it (uneven and empty shards included), an
expert stack split by each expert's rows, and a matrix HSDP shards (replicated over a second mesh
dim) take torch.optim.Muon's step on the whole matrix within 1e-6 (the learning rate adjusted by the
whole matrix's shape); each matrix is assembled on exactly one rank of its group, and no rank
receives more than the matrices it owns; pieces that do not tile their matrix are refused on every
rank. Then FSDP2 trains the single-rank Muon curve at tp=2 with
sequence parallelism (alone and with dp=2), pp=2, cp=2, ep=2 (experts sharded over two
expert-data-parallel ranks) and HSDP (two replicas of a two-rank shard group), and a tp=2 checkpoint
resumed at dp=2 continues it: every loss within test_muon.py's bound of the one-rank run's."""
from __future__ import annotations

import pytest
import torch

from tests.support.helpers import TINY, curve, read_metrics
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

pytestmark = pytest.mark.slow
COLUMN = [(8, 6), (2, 6)]  # full shapes split by output rows over tp (the second: an empty dp shard)
ROW = [(5, 8)]  # split by input columns over tp, its 5 rows unevenly over dp
DENSE = (6, 6)  # FSDP2-split over dp only (replicated over tp: its own group)
STACK = (3, 4, 5)  # experts x rows x cols, each expert's rows split over dp (FSDP2's Shard(1))
HSDP = (7, 3)  # Shard(0) over a mesh dim of two, replicated over the other


def _steps_against_torch(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megaframe.optim.muon import Muon
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.layers import ShardSpec
    from megaframe.parallel.state import ParallelState

    ps = ParallelState.build(ParallelDims(dp=2, tp=2))
    dp_mesh = DeviceMesh.from_group(ps.grad_reduce_group, "cpu", mesh_dim_names=("shard",))
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    t = ps.tp_rank
    generator = torch.Generator().manual_seed(0)
    split = [(shape, 0) for shape in COLUMN] + [(shape, 1) for shape in ROW]  # (full shape, TP-split dim)
    full = [torch.randn(*shape, generator=generator) for shape in (*(s for s, _ in split), DENSE, STACK, HSDP)]

    def tp_piece(value: torch.Tensor, dim: int) -> torch.Tensor:
        return value.chunk(2, dim)[t]

    def ours_of(value: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's DTensor of each: its TP piece split over dp, then the dense, stack and HSDP ones."""
        pieces = [distribute_tensor(tp_piece(v, dim).clone(), dp_mesh, [Shard(0)]) for v, (_, dim) in zip(value, split)]
        rest = value[len(split):]
        return [*pieces, distribute_tensor(rest[0].clone(), dp_mesh, [Shard(0)]),
                distribute_tensor(rest[1].clone(), dp_mesh, [Shard(1)]),
                distribute_tensor(rest[2].clone(), hsdp_mesh, [Replicate(), Shard(0)])]

    ours = [torch.nn.Parameter(d) for d in ours_of(full)]
    for p, (shape, dim) in zip(ours, split):  # parallel/layers.py's marks
        p.shard, p.partition_dim, p.partition_shape = ShardSpec("tp", dim), dim, shape
        p.partition_count, p.partition_index = 2, t
    reference = [torch.nn.Parameter(v.clone()) for v in full[:-2]] + [torch.nn.Parameter(full[-1].clone())]
    experts = [torch.nn.Parameter(full[-2][e].clone()) for e in range(STACK[0])]
    optimizer = Muon([{"params": ours, "optimizer": "muon", "lr": 0.02, "weight_decay": 0.1},
                      {"params": [], "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0}],
                     momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                     adjust_lr="spectral", betas=(0.9, 0.95), adamw_eps=1e-8, ps=ps)
    torch_muon = torch.optim.Muon([*reference, *experts], lr=0.02, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(v.shape, generator=generator) for v in full]  # the same on every rank
        for p, g in zip(ours, ours_of(grads)):
            p.grad = g
        for p, g in zip(reference, grads[:-2] + grads[-1:]):
            p.grad = g.clone()
        for e, p in enumerate(experts):
            p.grad = grads[-2][e].clone()
        optimizer.step()
        torch_muon.step()
    # pieces that do not tile their matrix (every rank marked as TP rank 0: one half twice, the
    # other never) are refused on every rank of the group, not stepped and not left waiting
    overlapping = torch.nn.Parameter(distribute_tensor(full[0].chunk(2, 0)[0].clone(), dp_mesh, [Shard(0)]))
    overlapping.shard, overlapping.partition_dim, overlapping.partition_shape = ShardSpec("tp", 0), 0, COLUMN[0]
    overlapping.partition_count, overlapping.partition_index = 2, 0
    try:
        Muon([{"params": [overlapping], "optimizer": "muon"}, {"params": [torch.nn.Parameter(torch.zeros(1))],
                                                                 "optimizer": "adamw"}], momentum=0.9, nesterov=True, ns_coefficients=(1, 1, 1),
             ns_steps=1, eps=1e-7, adjust_lr="spectral", betas=(0.9, 0.9), adamw_eps=1e-8, ps=ps)
        refused = ""
    except ValueError as e:
        refused = str(e)
    want = [tp_piece(r.detach(), dim) for r, (_, dim) in zip(reference, split)]
    want += [reference[len(split)].detach(), torch.stack([p.detach() for p in experts]), reference[-1].detach()]
    gaps = [(p.full_tensor() - w).abs().max().item() for p, w in zip(ours, want)]
    return {"gaps": gaps, "refused": refused, "groups": [{"owned": [tuple(s.shapes[i]) for i in s.owned()], "shapes": s.shapes,
                                      "received": s.received_numel,
                                      "owned_numel": sum(torch.Size(s.shapes[i]).numel() for i in s.owned())}
                                     for s in optimizer.split]}


def test_tp_and_dp_split_matrices_are_assembled_on_one_owner_each(tmp_path):
    results = run_ranks(_steps_against_torch, 4, tmp_path)
    for rank, result in enumerate(results):
        assert max(result["gaps"]) <= 1e-6, (rank, result["gaps"])
        assert "tile" in result["refused"], (rank, result["refused"])
        # no rank assembles a matrix it does not own: it receives exactly its own matrices' elements
        for group in result["groups"]:
            assert group["received"] == group["owned_numel"], (rank, group)
    # three groups: tp x dp (the TP pieces), dp (the dense matrix and the stack), the HSDP mesh's shard dim
    tp_group = [r["groups"][0] for r in results]
    assert sorted(tp_group[0]["shapes"]) == sorted([*COLUMN, *ROW]) and len(results[0]["groups"]) == 3
    owned = [shape for g in tp_group for shape in g["owned"]]
    assert sorted(owned) == sorted([*COLUMN, *ROW])  # each TP-split matrix on exactly one of the four ranks


BASE = [*TINY, "optim=muon", "backend=fsdp2", "train.max_steps=6"]
MOE = ["model=moe_tiny"]
TWO = {"tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.save_interval=3"],
       "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"],
       # tp2-sp's step-3 checkpoint (each TP piece's momentum buffer by name) resumed at dp=2
       "dp2-resumed-from-tp2": ["parallel.dp=2", "train.resume={tmp}/tp2-sp/checkpoints/global_step3"]}
FOUR = {"tp2-sp-dp2": ["parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true",
                       "optim.muon.exchange_bucket_size=20000"],  # several exchanges per group and step
        "hsdp-2x2": ["parallel.dp=4", "parallel.dp_replicate=2"],
        "moe-ep2-dp4": [*MOE, "parallel.dp=4", "parallel.ep=2"]}


def test_every_layout_trains_the_single_rank_muon_curve(tmp_path):
    refs = reference_runs({"dense": BASE, "moe": [*BASE, *MOE]}, tmp_path / "one")
    run_ranks(train_runs, 2, tmp_path, runs=[([*BASE, *(o.format(tmp=tmp_path) for o in extra)], str(tmp_path / name))
                                             for name, extra in TWO.items()])
    run_ranks(train_runs, 4, tmp_path, runs=[([*BASE, *extra], str(tmp_path / name)) for name, extra in FOUR.items()])
    for name in [*TWO, *FOUR]:
        one = curve(read_metrics(refs["moe" if name.startswith("moe") else "dense"]), "loss")
        got = curve(read_metrics(tmp_path / name), "loss")
        first = 4 if "resumed" in name else 1
        assert [s for s, _ in one] == list(range(1, 7)) and [s for s, _ in got] == list(range(first, 7)), name
        one = one[first - 1:]
        for (step, a), (_, b) in zip(got, one):
            assert a == pytest.approx(b, rel=1e-4), f"{name} at step {step}: {a} vs one rank's {b}"
