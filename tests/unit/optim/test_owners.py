"""optim/owners.py's buckets and owners at the scale they are for: optim.muon.exchange_bucket_size bounds
what one rank assembles per exchange, so every rank of a group owns matrices in every bucket, and the
busiest rank's Newton-Schulz work per step (each exchange waits for its busiest owner) stays near an
even share, at real models' shapes (the parameters Muon steps, from the model built on the meta device)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megaframe.config.compose import compose
from megaframe.model.factory import resolve_dims
from megaframe.model.gpt import GPT
from megaframe.optim.groups import muon_param_groups
from megaframe.optim.owners import assign_owners, bucket_owners, buckets, ns_cost

DEFAULT_BUCKET = 1_000_000_000  # optim.muon.exchange_bucket_size's default


def _muon_shapes(recipe: str, blocks: int | None = None) -> list[tuple[int, ...]]:
    """The full shapes of the matrices Muon steps, in the parameters' order (the order they are
    exchanged in), of `recipe`'s model, or of `blocks` of its blocks (a pipeline stage's)."""
    cfg, _ = compose([f"recipe={recipe}", "optim=muon"])
    model_cfg = dataclasses.replace(cfg.model, num_layers=blocks or cfg.model.num_layers)
    with torch.device("meta"):
        model = GPT(resolve_dims(model_cfg, cfg.model.vocab_size))
    return [tuple(p.shape) for p in muon_param_groups(model, cfg.optim)[0]["params"]]


# (recipe, blocks per group of ranks, ranks): gpt_1t's pipeline stage (128 layers over pp=64) over its
# tp8 x dp6; Llama-2 70B's whole model under FSDP2 at dp=512; Llama-2 7B's at dp=64
SCALES = {"gpt_1t_tp8dp6": ("gpt_1t", 2, 48), "llama2_70b_dp512": ("llama2_70b", None, 512),
          "llama2_7b_dp64": ("llama2_7b", None, 64)}


@pytest.mark.parametrize("name", sorted(SCALES))
def test_every_rank_owns_and_the_busiest_runs_about_an_even_share(name):
    """In the default buckets: at least min(ranks, matrices) distinct owners (bounding each bucket's
    total put every gpt_1t matrix on rank 0 and 10 of 512 ranks to work at 70B); no owner assembles more
    than the bucket in one exchange unless it holds a single matrix there; the buckets are consecutive
    runs of the matrices in order; and the busiest rank's work, summed over the buckets (each exchange
    waits for its busiest owner), is within 1.25 x the larger of an even share (total / ranks) and the
    largest matrix's (no owner assignment can beat either)."""
    recipe, blocks, ranks = SCALES[name]
    shapes = _muon_shapes(recipe, blocks)
    runs, owners = bucket_owners(shapes, ranks, DEFAULT_BUCKET)
    assert [i for run in runs for i in run] == list(range(len(shapes))) and all(runs)
    assert len(set(owners)) >= min(ranks, len(shapes)) and all(0 <= o < ranks for o in owners)
    busiest = 0
    for run in runs:
        held: dict[int, list[int]] = {}
        for i in run:
            held.setdefault(owners[i], []).append(i)
        for owner, mine in held.items():
            assert len(mine) == 1 or sum(math.prod(shapes[i]) for i in mine) <= DEFAULT_BUCKET, (owner, mine)
        busiest += max(sum(ns_cost(shapes[i]) for i in mine) for mine in held.values())
    total = sum(ns_cost(s) for s in shapes)
    bound = max(total / ranks, max(ns_cost(s) for s in shapes))
    assert busiest <= 1.25 * bound, (name, busiest / bound)


def test_the_owners_follow_the_rule_by_hand():
    """Elements 20, 10, 9, 100, 1, 4 (costs 80, 20, 27, 1000, 1, 8) over two ranks, at most 30 elements
    each per bucket: 20 to rank 0; 10 to idle rank 1 (cost 0 in the bucket); 9 to rank 1 (room on both,
    the less cost in the bucket); 100 fits no rank that owns something, and none is idle: a new bucket,
    where it goes alone to rank 1 (the less cost carried: 47 against 80); 1 to idle rank 0; 4 to rank 0,
    the only one with room."""
    shapes = [(4, 5), (2, 5), (3, 3), (10, 10), (1, 1), (2, 2)]
    assert bucket_owners(shapes, 2, 30) == ([[0, 1, 2], [3, 4, 5]], [0, 1, 1, 1, 0, 0])
    # at one rank the bound is each bucket's total, a larger matrix alone
    assert buckets(shapes, 30) == [[0, 1], [2], [3], [4, 5]]


def test_a_bucket_of_zero_is_one_exchange_balanced_costliest_first():
    """exchange_bucket_size=0: every matrix in one bucket, owners exactly assign_owners' (costliest first
    onto the least loaded rank), at real shapes and tiny ones."""
    for shapes, ranks in ((_muon_shapes("llama2_7b"), 64), (_muon_shapes("gpt_1t", 2), 48),
                          ([(4, 5), (2, 5), (3, 3), (10, 10), (1, 1), (2, 2)], 4)):
        assert bucket_owners(shapes, ranks, 0) == ([list(range(len(shapes)))], assign_owners(shapes, ranks))
    assert bucket_owners([], 8, 0) == bucket_owners([], 8, 30) == ([], [])


def test_the_work_does_not_grow_with_the_groups_ranks():
    """The planner assigns owners for thousands of matrices over thousands of ranks per layout it tries:
    ranks never chosen are never visited, so a group of 10^9 ranks costs what 560 do (each of Llama-2
    70B's 560 matrices to its own idle rank, lowest first, all in one bucket, then each of those ranks
    one of them, costliest first)."""
    shapes = _muon_shapes("llama2_70b")
    runs, owners = bucket_owners(shapes, 10 ** 9, DEFAULT_BUCKET)
    assert runs == [list(range(len(shapes)))] and sorted(owners) == list(range(len(shapes)))
