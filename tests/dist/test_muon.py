"""Muon over data-parallel ranks (optim/sharded.py), two gloo ranks: matrices split by rows as
FSDP2 splits them (DTensor Shard(0), uneven and empty shards included) take torch.optim.Muon's
step on the whole matrix (the oracle) within 1e-6; each rank assembles only the matrices it owns,
about half the Newton-Schulz work each; an expert stack split by experts is stepped where it lies.
Then FSDP2 at dp=2 trains the single-rank Muon curve."""
from __future__ import annotations

import pytest
import torch

from tests.support.helpers import TINY, curve, read_metrics
from tests.support.muon_oracle import TorchMuon
from tests.support.parity import train_runs
from tests.support.ranks import run_ranks

SHAPES = [(5, 3), (4, 6), (1, 8), (6, 6), (7, 2)]  # tall, wide, fewer rows than ranks, square
STACK = (4, 5, 3)  # experts x rows x cols: split by experts, each rank steps its own


BUCKET = 40  # the most elements of whole matrices one rank assembles per exchange: SHAPES' 97 in two buckets


def _steps_against_torch(rank: int, world: int) -> dict:
    """For one exchange of all matrices (bucket 0) and for BUCKET: this rank's gaps to torch's Muon,
    what it owns and what it received; and under "wire", the bf16 exchange against the fp32 one."""
    return {**{bucket: _steps_in_buckets(bucket) for bucket in (0, BUCKET)}, "wire": _wire_dtypes()}


def _steps_in_buckets(bucket: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megaframe.optim.muon import Muon

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(*shape, generator=generator) for shape in (*SHAPES, STACK)]
    ours = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
    optimizer = Muon([{"params": ours, "optimizer": "muon", "lr": 0.02, "weight_decay": 0.1},
                      {"params": [], "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0}],
                     momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                     adjust_lr="spectral", betas=(0.9, 0.95), adamw_eps=1e-8, exchange_bucket_size=bucket)
    torch_muon = TorchMuon(full)
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=generator) for t in full]  # the same on both ranks
        for p, g in zip(ours, grads):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        optimizer.step()
        torch_muon.step(grads)
    gaps = [(p.full_tensor() - want).abs().max().item() for p, want in zip(ours, torch_muon.tensors())]
    rows, = optimizer.split
    owned = rows.owned()
    return {"gaps": gaps, "owned": owned, "received": rows.received_numel, "largest": rows.largest_received,
            "owned_numel": sum(torch.Size(rows.shapes[i]).numel() for i in owned), "wire": rows.wire_dtype}


def _wire_dtypes() -> dict:
    """The same row-sharded updates exchanged with Muon's orthogonalisation over an fp32 wire and over
    Muon's bf16 one, in one exchange and in buckets: whether each result and each parameter stepped
    with it are the same bits, and the dtypes the results come back in."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megaframe.optim.muon import EXCHANGE_DTYPE, _decay_and_step, orthogonalise, whole
    from megaframe.optim.pieces import piece
    from megaframe.optim.sharded import ShardedMatrices

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(*shape, generator=generator), mesh, [Shard(0)]))
              for shape in SHAPES]
    updates = [whole(distribute_tensor(torch.randn(*shape, generator=generator), mesh, [Shard(0)])) for shape in SHAPES]
    group = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr": "spectral"}

    def newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
        return orthogonalise(matrix, (3.4445, -4.775, 2.0315), 5, 1e-7)
    same, dtypes = [], set()
    for bucket in (0, BUCKET):
        stepped = {}
        for dtype in (torch.float32, EXCHANGE_DTYPE):
            matrices = ShardedMatrices([piece(p) for p in params], torch.device("cpu"), params=params,
                                       bucket_elements=bucket, wire_dtype=dtype)
            results = []
            for ids in matrices.in_buckets(range(len(params))):  # as Muon's step: a bucket at a time
                results += matrices.orthogonalise([(params[k], updates[k].clone(), newton_schulz) for k in ids])
            dtypes |= {(str(dtype), str(r.dtype)) for r in results}
            local = [whole(p).detach().clone() for p in params]
            for param, result, shape in zip(local, results, SHAPES):
                _decay_and_step(group, param, result, shape)
            stepped[dtype] = (results, local)
        (r32, p32), (r16, p16) = stepped[torch.float32], stepped[EXCHANGE_DTYPE]
        same += [torch.equal(a, b.float()) for a, b in zip(r32, r16)] + [torch.equal(a, b) for a, b in zip(p32, p16)]
    return {"same": same, "dtypes": sorted(dtypes)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """_steps_against_torch on two gloo ranks, once for this module's tests."""
    return run_ranks(_steps_against_torch, 2, tmp_path_factory.mktemp("muon_rows"))


def test_the_bf16_exchange_is_the_fp32_exchange_to_the_bit(two_ranks):
    """Muon's exchange carries the pieces and assembles the matrices in bf16 (half the bytes): as
    Newton-Schulz casts to bf16 first, each result, and each fp32 parameter stepped with it, is the
    fp32 exchange's to the bit, on both ranks (one holds an empty piece), in one exchange and in buckets."""
    for rank, result in enumerate(r["wire"] for r in two_ranks):
        assert result["same"] and all(result["same"]), (rank, result)
        assert result["dtypes"] == [("torch.bfloat16", "torch.bfloat16"), ("torch.float32", "torch.float32")], result


def test_row_sharded_muon_is_torch_muon_on_the_whole_matrix(two_ranks):
    """In one exchange and in buckets of at most BUCKET elements per owner: torch's step (Muon's exchange
    in bf16), each matrix assembled on its owner alone; in buckets, no exchange receives more than a
    bucket (in one, a rank receives more)."""
    by_rank = two_ranks
    assert {r[b]["wire"] for r in by_rank for b in (0, BUCKET)} == {torch.bfloat16}, by_rank
    for bucket in (0, BUCKET):
        results = [r[bucket] for r in by_rank]
        for rank, result in enumerate(results):
            assert max(result["gaps"]) <= 1e-6, (bucket, rank, result["gaps"])
            # no rank assembles a matrix it does not own: what it received is exactly its own matrices
            assert result["received"] == result["owned_numel"] > 0, (bucket, rank, result)
        owners = [set(r["owned"]) for r in results]
        assert owners[0].isdisjoint(owners[1]) and owners[0] | owners[1] == set(range(len(SHAPES)))
    assert max(r[BUCKET]["largest"] for r in by_rank) <= BUCKET < max(r[0]["largest"] for r in by_rank), by_rank


def _alone_without_an_exchange(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megaframe.optim.pieces import Piece
    from megaframe.optim.sharded import ShardedMatrices

    def refused(*args, **kwargs):
        raise AssertionError("an all_to_all over a group of one rank")

    dist.all_to_all_single = refused  # in this forked rank only
    matrices = ShardedMatrices([Piece(shape, (0, 0), shape, dist.group.WORLD) for shape in SHAPES], torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(*shape, generator=generator) for shape in SHAPES]
    results = matrices.exchange([(i, u, lambda m: 2 * m + 1) for i, u in enumerate(updates)])
    return {"gaps": [(r.view(u.shape) - (2 * u + 1)).abs().max().item() for r, u in zip(results, updates)],
            "received": matrices.received_numel, "owned": matrices.owned()}


def test_a_group_of_one_rank_exchanges_without_a_collective(tmp_path):
    """A group of one (each expert group at ep = dp under DeepSpeed) calls no collective for its
    exchange, and its owner still applies each matrix's function to the whole matrix."""
    result, = run_ranks(_alone_without_an_exchange, 1, tmp_path)
    assert result["gaps"] == [0.0] * len(SHAPES), result
    assert result["owned"] == list(range(len(SHAPES))), result
    assert result["received"] == sum(torch.Size(s).numel() for s in SHAPES), result


def test_fsdp2_at_two_ranks_trains_and_resumes_the_single_rank_muon_curve(tmp_path):
    """dp=2 from the start, and dp=2 resumed from the one-rank run's step-3 checkpoint (its momentum
    buffers read by name into each rank's rows): both follow the one-rank curve."""
    base = [*TINY, "optim=muon", "backend=fsdp2", "train.max_steps=6"]
    saved = tmp_path / "one" / "checkpoints" / "global_step3"
    run_ranks(train_runs, 1, tmp_path, runs=[([*base, "train.save_interval=3"], str(tmp_path / "one"))])
    run_ranks(train_runs, 2, tmp_path, runs=[([*base, "parallel.dp=2"], str(tmp_path / "two")),
                                             ([*base, "parallel.dp=2", f"train.resume={saved}"], str(tmp_path / "resumed"))])
    one, two, resumed = (curve(read_metrics(tmp_path / name), "loss") for name in ("one", "two", "resumed"))
    assert [s for s, _ in two] == [s for s, _ in one] == list(range(1, 7)) and [s for s, _ in resumed] == [4, 5, 6]
    for (step, a), (_, b) in [*zip(two, one), *zip(resumed, one[3:])]:
        assert a == pytest.approx(b, rel=1e-4), f"dp=2 at step {step}: {a} vs one rank's {b}"
