"""Tensor-parallel layers against nn.Linear / nn.Embedding holding the full weight, and
vocab-parallel cross-entropy against F.cross_entropy, with real gloo ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaframe.parallel.cross_entropy import vocab_parallel_cross_entropy
from megaframe.parallel.layers import ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding
from megaframe.parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from tests.support.numerics import assert_fp32_close
from tests.support.ranks import run_ranks

B, T, IN, OUT, VOCAB, PADDED = 2, 4, 6, 8, 13, 16


def _data():
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(B, T, IN, generator=g), w=torch.randn(OUT, IN, generator=g),
                b=torch.randn(OUT, generator=g), gy=torch.randn(B, T, OUT, generator=g),
                w_row=torch.randn(IN, OUT, generator=g), b_row=torch.randn(IN, generator=g),
                gy_row=torch.randn(B, T, IN, generator=g), emb=torch.randn(PADDED, IN, generator=g),
                ids=torch.randint(0, VOCAB, (B, T), generator=g), logits=torch.randn(B, T, PADDED, generator=g))


def _full_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grad_out: torch.Tensor) -> tuple:
    """(output, input grad, weight grad, bias grad) of one unsharded nn.Linear."""
    x = x.clone().requires_grad_(True)
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], dtype=x.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight); lin.bias.copy_(bias)
    y = lin(x); y.backward(grad_out)
    return y.detach(), x.grad, lin.weight.grad, lin.bias.grad


def _reference(dtype: torch.dtype) -> dict:
    """The unsharded modules on the same (fp32) data, computed in `dtype`."""
    d = {key: value.to(dtype) if value.is_floating_point() else value for key, value in _data().items()}
    out = {}
    out["col"] = _full_linear(d["x"], d["w"], d["b"], d["gy"])
    out["row"] = _full_linear(d["gy"], d["w_row"], d["b_row"], d["gy_row"])
    emb = torch.nn.Embedding(PADDED, IN, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(d["emb"])
    e = emb(d["ids"]); e.backward(d["x"])
    out["emb"] = (e.detach(), emb.weight.grad)
    logits = d["logits"].clone().requires_grad_(True)
    targets = d["ids"].clone(); targets[0, :2] = -100
    loss = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    out["ce"] = (loss.detach(), logits.grad)
    return out


def _tp_layers(rank: int, world: int, sequence_parallel: bool) -> dict:
    d = _data()
    tp = TPGroup(group=dist.group.WORLD, size=world, rank=rank, sequence_parallel=sequence_parallel)
    shard = lambda t, dim: t.chunk(world, dim=dim)[rank]
    seq = lambda t: t.chunk(world, dim=1)[rank] if sequence_parallel else t  # this rank's input rows
    out = {}
    # column-parallel: full input (or this rank's sequence shard under SP), output columns split
    col = ColumnParallelLinear(IN, OUT, tp)
    with torch.no_grad():
        col.weight.copy_(shard(d["w"], 0)); col.bias.copy_(shard(d["b"], 0))
    x = seq(d["x"]).clone().requires_grad_(True)
    y = col(x); y.backward(shard(d["gy"], -1))
    out["col"] = (y.detach(), x.grad, col.weight.grad, col.bias.grad)
    # row-parallel: input columns split, output summed (reduce-scattered along T under SP)
    row = RowParallelLinear(OUT, IN, tp)
    with torch.no_grad():
        row.weight.copy_(shard(d["w_row"], 1)); row.bias.copy_(d["b_row"])
    h = shard(d["gy"], -1).clone().requires_grad_(True)
    y = row(h); y.backward(seq(d["gy_row"]))
    out["row"] = (y.detach(), h.grad, row.weight.grad, row.bias.grad)
    emb = VocabParallelEmbedding(PADDED, IN, tp)
    with torch.no_grad():
        emb.weight.copy_(shard(d["emb"], 0))
    e = emb(d["ids"]); e.backward(d["x"])
    out["emb"] = (e.detach(), emb.weight.grad)
    logits = shard(d["logits"], -1).clone().requires_grad_(True)
    targets = d["ids"].clone(); targets[0, :2] = -100
    loss = vocab_parallel_cross_entropy(logits, targets, tp, vocab_start=rank * PADDED // world, vocab_size=VOCAB)
    loss.backward()
    out["ce"] = (loss.detach(), logits.grad)
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_layers_match_full_weight_modules(world, sequence_parallel, tmp_path):
    # one forward/backward: TP splits the inner dimension into per-rank partial sums, which round
    # differently from the full layer by an amount that depends on the host's SIMD width: each
    # value must lie within a few times the fp32 reference's own rounding of fp64 (tests/support/numerics.py)
    ref64, ref32 = _reference(torch.float64), _reference(torch.float32)
    results = run_ranks(_tp_layers, world, tmp_path, sequence_parallel=sequence_parallel)
    seq = lambda t, r: t.chunk(world, dim=1)[r] if sequence_parallel else t
    for rank, got in enumerate(results):
        shard = lambda t, dim: t.chunk(world, dim=dim)[rank]

        def close(value, layer: str, index: int, part=lambda t: t) -> None:
            what = f"tp={world}{' sp' if sequence_parallel else ''} rank {rank} {layer}[{index}]"
            assert_fp32_close(value, part(ref64[layer][index]), part(ref32[layer][index]), what)

        y, gx, gw, gb = got["col"]
        close(y, "col", 0, lambda t: shard(t, -1))  # column output
        close(gx, "col", 1, lambda t: seq(t, rank))  # column input grad (all-reduced / reduce-scattered)
        close(gw, "col", 2, lambda t: shard(t, 0))
        close(gb, "col", 3, lambda t: shard(t, 0))
        y, gh, gw, gb = got["row"]
        close(y, "row", 0, lambda t: seq(t, rank))
        close(gh, "row", 1, lambda t: shard(t, -1))
        close(gw, "row", 2, lambda t: shard(t, 1))
        # the bias is replicated; under SP each rank sees its sequence shard, summed over TP by sync_grad
        close(gb, "row", 3)
        e, gemb = got["emb"]
        close(e, "emb", 0)  # vocab-parallel embedding
        close(gemb, "emb", 1, lambda t: shard(t, 0))
        loss, glogits = got["ce"]
        close(loss, "ce", 0)  # vocab-parallel cross-entropy
        close(glogits, "ce", 1, lambda t: shard(t, -1))  # its gradient (padded columns get none)
        columns = torch.arange(rank * PADDED // world, (rank + 1) * PADDED // world)
        assert torch.all(glogits[..., columns >= VOCAB] == 0), "padded vocabulary columns got gradient"
