"""Each TP/SP collective's forward and backward against its single-process equivalent."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megaframe.parallel import mappings
from tests.support.ranks import run_ranks

WORLD = 2
B, T, C = 2, 4, 6


def _inputs(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's input x_r and upstream gradient g_r, known to every rank."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, T, C, generator=g) for _ in range(world)]
    gs = [torch.randn(B, T, C, generator=g) for _ in range(world)]
    return xs, gs


def _apply_all(rank: int, world: int) -> dict:
    xs, gs = _inputs(world)
    out = {}
    for name in ("copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
                 "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
                 "reduce_scatter_to_sequence_parallel_region"):
        x = xs[rank].clone().requires_grad_(True)
        y = getattr(mappings, name)(x, dist.group.WORLD)
        # upstream gradient of y's shape, different on every rank
        g = gs[rank]
        if y.shape[-1] != C:
            g = torch.cat([g] * world, dim=-1) if y.shape[-1] > C else g.chunk(world, dim=-1)[0]
        elif y.shape[1] != T:
            g = torch.cat([g] * world, dim=1) if y.shape[1] > T else g.chunk(world, dim=1)[0]
        y.backward(g)
        out[name] = (y.detach(), x.grad.detach(), g)
    return out


def test_mappings_forward_and_backward(tmp_path):
    results = run_ranks(_apply_all, WORLD, tmp_path)
    xs, _ = _inputs(WORLD)
    for rank, res in enumerate(results):
        ups = [r_res for r_res in results]
        def grads(name):  # every rank's upstream gradient for this mapping
            return [u[name][2] for u in ups]

        y, gx, _ = res["copy_to_tp_region"]
        assert torch.equal(y, xs[rank])
        assert torch.allclose(gx, sum(grads("copy_to_tp_region")))

        y, gx, g = res["reduce_from_tp_region"]
        assert torch.allclose(y, sum(xs))
        assert torch.equal(gx, g)

        y, gx, _ = res["scatter_to_tp_region"]
        assert torch.equal(y, xs[rank].chunk(WORLD, -1)[rank])
        assert torch.equal(gx, torch.cat(grads("scatter_to_tp_region"), -1))

        y, gx, g = res["gather_from_tp_region"]
        assert torch.equal(y, torch.cat(xs, -1))
        assert torch.equal(gx, g.chunk(WORLD, -1)[rank])

        y, gx, _ = res["scatter_to_sequence_parallel_region"]
        assert torch.equal(y, xs[rank].chunk(WORLD, 1)[rank])
        assert torch.equal(gx, torch.cat(grads("scatter_to_sequence_parallel_region"), 1))

        y, gx, _ = res["gather_from_sequence_parallel_region"]
        assert torch.equal(y, torch.cat(xs, 1))
        assert torch.allclose(gx, sum(grads("gather_from_sequence_parallel_region")).chunk(WORLD, 1)[rank])

        y, gx, _ = res["reduce_scatter_to_sequence_parallel_region"]
        assert torch.allclose(y, sum(xs).chunk(WORLD, 1)[rank])
        assert torch.equal(gx, torch.cat(grads("reduce_scatter_to_sequence_parallel_region"), 1))


def test_single_rank_group_is_identity():
    x = torch.randn(B, T, C, requires_grad=True)
    for name in ("copy_to_tp_region", "reduce_from_tp_region", "gather_from_sequence_parallel_region"):
        assert getattr(mappings, name)(x, None) is x


def _token_mappings(rank: int, world: int) -> dict:
    """split_tokens, gather_tokens and all_to_all_rows (uneven splits) with per-rank upstream grads."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, C, generator=g) for _ in range(world)]
    gs = [torch.randn(12, C, generator=g) for _ in range(world)]
    # rank r sends send[r][j] rows to rank j, in order
    send = [[1, 4], [3, 2]]
    out = {}
    x = xs[rank].clone().requires_grad_(True)
    y = mappings.split_tokens(x, dist.group.WORLD)
    y.backward(gs[rank][:3])
    out["split"] = (y.detach(), x.grad.detach())
    x = xs[rank].clone().requires_grad_(True)
    y = mappings.gather_tokens(x, dist.group.WORLD)
    y.backward(gs[rank])
    out["gather"] = (y.detach(), x.grad.detach())
    x = xs[rank][: sum(send[rank])].clone().requires_grad_(True)
    received = [send[j][rank] for j in range(world)]
    y = mappings.all_to_all_rows(x, received, send[rank], dist.group.WORLD)
    y.backward(gs[rank][: sum(received)])
    out["all_to_all"] = (y.detach(), x.grad.detach())
    return out


def test_token_mappings_forward_and_backward(tmp_path):
    results = run_ranks(_token_mappings, WORLD, tmp_path)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, C, generator=g) for _ in range(WORLD)]
    gs = [torch.randn(12, C, generator=g) for _ in range(WORLD)]
    send = [[1, 4], [3, 2]]
    for rank, res in enumerate(results):
        y, gx = res["split"]
        assert torch.equal(y, xs[rank][3 * rank: 3 * rank + 3])
        assert torch.equal(gx, torch.cat([gs[r][:3] for r in range(WORLD)]))  # the rows' gradients, gathered
        y, gx = res["gather"]
        assert torch.equal(y, torch.cat(xs))
        assert torch.equal(gx, gs[rank][6 * rank: 6 * rank + 6])  # this rank's rows of a replicated gradient
        # all-to-all: rows from every source in source order; the gradient goes back where each row came from
        y, gx = res["all_to_all"]
        expected = []
        for source in range(WORLD):
            start = sum(send[source][:rank])
            expected.append(xs[source][start: start + send[source][rank]])
        assert torch.equal(y, torch.cat(expected))
        back = []
        for dest in range(WORLD):
            received = [send[j][dest] for j in range(WORLD)]
            start = sum(received[:rank])
            back.append(gs[dest][start: start + send[rank][dest]])
        assert torch.equal(gx, torch.cat(back))
