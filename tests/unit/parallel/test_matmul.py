"""The matmul seam (parallel/matmul.py): a recipe passed at build sees every weight matmul of the
model, each at its site's kind, counted against what the config says the model holds (computed
here from the config's numbers, not from the model's layer list); and the default recipe is
today's arithmetic."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megaframe.config.compose import compose
from megaframe.model.factory import build_model
from megaframe.model.gpt import ReplicatedLinear
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.layers import TPGroup
from megaframe.parallel.matmul import DEFAULT, KINDS, MatmulRecipe, MatmulSite, spans_tp
from megaframe.parallel.state import ParallelState
from megaframe.model.dims import resolve_dims

VOCAB = 96


@dataclasses.dataclass(frozen=True)
class Recording(MatmulRecipe):
    """The default arithmetic, counting each call by its site's kind (and checking the operands)."""

    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter, compare=False)

    def linear(self, x, weight, bias, site):
        assert weight.shape[-1] == x.shape[-1] and site.tp.matmul is self
        self.calls[site.kind] += 1
        return super().linear(x, weight, bias, site)

    def grouped_mm(self, x, weight, offsets, site):
        assert weight.dim() == 3 and offsets.dtype == torch.int32
        self.calls[f"{site.kind} grouped"] += 1
        return super().grouped_mm(x, weight, offsets, site)


def _expected(model) -> collections.Counter:
    """Weight matmuls per forward from the config alone: attention q, k, v (column) and out (row);
    a dense MLP's up (+ gate for SwiGLU) column and down row; a routed block's router and one
    grouped GEMM per expert projection, plus its shared experts' dense MLP; the LM head."""
    projections = 3 if model.activation == "swiglu" else 2
    moe = model.moe
    routed = 0
    if moe is not None and moe.num_experts:
        routed = sum(1 for i in range(model.num_layers)
                     if i >= moe.first_dense_layers and (i - moe.first_dense_layers) % moe.layer_freq == 0)
    dense = model.num_layers - routed
    shared = routed if moe is not None and moe.shared_experts else 0
    want = collections.Counter({"column": 3 * model.num_layers + (projections - 1) * (dense + shared),
                                "row": model.num_layers + dense + shared, "head": 1})
    if routed:
        want["router"] = routed
        want["experts grouped"] = projections * routed
    return want


@pytest.mark.parametrize("flavour", ["gpt_tiny", "llama_tiny", "moe_tiny"])
def test_a_recipe_passed_at_build_sees_every_weight_matmul(flavour):
    cfg = compose([f"model={flavour}", "model.num_layers=2", "model.seq_length=16"])[0]
    dims = resolve_dims(cfg.model, VOCAB)
    recipe = Recording()
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=1, matmul=recipe)
    reference = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=1)
    idx = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        logits = model.logits(idx)
        assert recipe.calls == _expected(cfg.model), flavour
        assert torch.equal(logits, reference.logits(idx))  # the default arithmetic, bitwise


def test_a_replicated_linear_and_the_expert_loop_go_through_the_seam():
    """The sites a tp=1 float32 forward does not reach: kv projections replicated when tp exceeds
    the kv heads, and the per-expert loop that replaces the grouped GEMM where torch has none."""
    from megaframe.model.moe import grouped_linear

    recipe = Recording()
    tp = TPGroup(size=2, matmul=recipe)  # forward only: no collective runs
    layer = ReplicatedLinear(8, 4, tp, bias=True)
    torch.nn.init.normal_(layer.weight), torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    x64, w64 = torch.randn(5, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    looped = grouped_linear(x64, w64, torch.tensor([2, 3]), site=tp.site("experts"))
    assert torch.equal(looped, torch.cat([x64[:2] @ w64[0].t(), x64[2:] @ w64[1].t()]))
    assert recipe.calls == {"replicated": 1, "experts": 2}


def test_sites_say_which_operands_span_the_tp_group():
    """What an fp8 recipe reduces its amax over: the split operands of each kind."""
    assert set(KINDS) == {"column", "row", "replicated", "head", "router", "experts"}
    assert spans_tp("row") == ("input", "weight") and spans_tp("column") == ("weight",)
    assert spans_tp("replicated") == ()
    with pytest.raises(ValueError, match="unknown matmul kind"):
        MatmulSite("diagonal", TPGroup())
    assert TPGroup().matmul is DEFAULT
