"""optim=muon at one rank against torch's own optimizers (the oracle: torch.optim.Muon and
torch.optim.AdamW, which share no code with megaframe/optim/muon.py): megaframe's GPT trained side
by side for 10 steps, every parameter within 1e-6 at every step; a MoE layer's expert stack stepped
as torch steps each expert's matrix on its own; the optimizer state counted by name; the matrices of
one shape orthogonalised as one stack of bounded size."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaframe.backends.common import held_model_states
from megaframe.config.schema import ModelConfig, MoEConfig, MuonConfig, OptimConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.optim.build import build_optimizer, param_groups
from megaframe.optim.groups import is_hidden_matrix
from megaframe.optim import muon
from megaframe.optim.muon import Muon
from megaframe.optim.owners import assign_owners, bucket_owners, buckets, ns_cost
from megaframe.optim.state import ensure_state
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

VOCAB, SEQ = 200, 16
# gpt2-style (biases, layernorm gains and biases, learned positions, tied head) and llama-style (an
# untied head, rmsnorm, swiglu's gate_proj): every kind of parameter the two groups split
MODELS = {"gpt2": ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                              seq_length=SEQ, vocab_size=VOCAB),
          "llama": ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                               ffn_hidden_size=48, seq_length=SEQ, vocab_size=VOCAB, norm="rmsnorm",
                               activation="swiglu", position_embedding="rope", tie_embeddings=False, bias=False)}
# torch.optim.Muon's name for each adjust_lr
TORCH_ADJUST = {"spectral": "original", "match_rms_adamw": "match_rms_adamw"}
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "out_proj", "up_proj", "gate_proj", "down_proj"}


def _model(cfg: ModelConfig) -> torch.nn.Module:
    return build_model(resolve_dims(cfg, VOCAB), ParallelState(ParallelDims(), rank=0), seed=3)


def _optim(adjust_lr: str, nesterov: bool) -> OptimConfig:
    return OptimConfig(name="muon", lr=0.02, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8,
                       muon=MuonConfig(momentum=0.9, nesterov=nesterov, ns_steps=5, adjust_lr=adjust_lr,
                                       adamw_lr=3e-3, adamw_weight_decay=0.05))


def _torch_pair(model: torch.nn.Module, o: OptimConfig) -> list[torch.optim.Optimizer]:
    """torch's Muon on the projections' weights (named here, not by megaframe's rule), torch's AdamW on
    the rest: matrices decayed, vectors not."""
    named = list(model.named_parameters())
    is_projection = {n: n.endswith(".weight") and n.rsplit(".", 2)[-2] in PROJECTIONS for n, _ in named}
    m = o.muon
    muon = torch.optim.Muon([p for n, p in named if is_projection[n]], lr=o.lr, weight_decay=o.weight_decay,
                            momentum=m.momentum, nesterov=m.nesterov, ns_coefficients=tuple(m.ns_coefficients),
                            eps=m.eps, ns_steps=m.ns_steps, adjust_lr_fn=TORCH_ADJUST[m.adjust_lr])
    adamw = torch.optim.AdamW([{"params": [p for n, p in named if not is_projection[n] and p.ndim >= 2],
                                "weight_decay": m.adamw_weight_decay},
                               {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}],
                              lr=m.adamw_lr, betas=tuple(o.betas), eps=o.eps, fused=True)
    return [muon, adamw]


@pytest.mark.parametrize("arch, adjust_lr, nesterov", [("gpt2", "spectral", True), ("llama", "match_rms_adamw", False)])
def test_muon_trains_as_torch_muon_and_adamw_side_by_side(arch, adjust_lr, nesterov):
    o = _optim(adjust_lr, nesterov)
    ours_model = _model(MODELS[arch])
    theirs_model = copy.deepcopy(ours_model)
    ours = build_optimizer(ours_model, o)
    theirs = _torch_pair(theirs_model, o)
    muon_names = {n for n, p in ours_model.named_parameters() if any(p is q for q in ours.param_groups[0]["params"])}
    assert {n.rsplit(".", 2)[-2] for n in muon_names} >= {"q_proj", "out_proj", "up_proj", "down_proj"}
    assert not any(n.startswith(("embed.", "head.")) or "norm" in n or n.endswith(".bias") for n in muon_names)
    generator = torch.Generator().manual_seed(0)
    for step in range(10):
        ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
        for model, optimizers in ((ours_model, [ours]), (theirs_model, theirs)):
            model(ids[:, :-1], ids[:, 1:]).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        for (name, a), b in zip(ours_model.named_parameters(), theirs_model.parameters()):
            assert (a - b).abs().max().item() <= 1e-6, f"{name} after step {step + 1}"
    moved = sum((a - b).abs().sum().item() for a, b in zip(ours_model.parameters(), _model(MODELS[arch]).parameters()))
    assert moved > 1.0  # the steps did move the weights (a comparison of two frozen models passes anything)


def test_an_expert_stack_is_orthogonalised_per_expert():
    """A (experts, rows, cols) stack: each expert's matrix takes torch.optim.Muon's step for that
    matrix alone (torch refuses the stack itself), its rate adjusted by rows and cols."""
    torch.manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(4, 24, 16))  # tall experts: the transposed path
    slices = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(4)]
    ours = Muon([{"params": [stack], "optimizer": "muon", "lr": 0.02, "weight_decay": 0.1},
                 {"params": [], "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0}],
                momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                adjust_lr="match_rms_adamw", betas=(0.9, 0.95), adamw_eps=1e-8)
    theirs = torch.optim.Muon(slices, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(4):
        grad = torch.randn(4, 24, 16)
        stack.grad = grad.clone()
        for e, p in enumerate(slices):
            p.grad = grad[e].clone()
        ours.step()
        theirs.step()
        for e, p in enumerate(slices):
            torch.testing.assert_close(stack.detach()[e], p.detach(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="matrices and stacks"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "optimizer": "muon"}], momentum=0.9, nesterov=True,
             ns_coefficients=(1, 1, 1), ns_steps=1, eps=1e-7, adjust_lr="spectral", betas=(0.9, 0.9), adamw_eps=1e-8)


def test_muon_state_is_counted_by_name():
    """One momentum buffer per Muon matrix, AdamW's two moments for the rest (a MoE model: its stack
    and router included): the memory accounting reads the optimizer's state table."""
    cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                      seq_length=SEQ, vocab_size=VOCAB, norm="rmsnorm", activation="swiglu",
                      position_embedding="rope", bias=False, moe=MoEConfig(num_experts=4, ffn_hidden_size=16))
    model = _model(cfg)
    optimizer = build_optimizer(model, _optim("spectral", True))
    ensure_state(optimizer, 0)
    muon = {id(p) for p in optimizer.param_groups[0]["params"]}
    stacks = [n for n, p in model.named_parameters() if id(p) in muon and p.ndim == 3]
    assert stacks and not any("router" in n for n, p in model.named_parameters() if id(p) in muon)
    params = list(model.parameters())
    want = sum(4 * p.numel() * (1 if id(p) in muon else 2) for p in params)
    assert held_model_states(params, optimizer)["optimizer"] == want
    assert set(optimizer.state[optimizer.param_groups[0]["params"][0]]) == {"momentum_buffer"}
    with pytest.raises(ValueError, match="this engine steps adamw only"):  # DeepSpeed's groups: never Muon's
        param_groups(model, _optim("spectral", True))


def test_at_four_ranks_each_owns_about_a_quarter_of_the_newton_schulz_work():
    """The owners of a 4-layer model's matrices over dp=4, in one exchange and in the default buckets:
    each rank's Newton-Schulz cost within 25% of a quarter (a function of the shapes only: every rank
    computes the same)."""
    cfg = ModelConfig(arch="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=176, seq_length=SEQ, vocab_size=VOCAB, norm="rmsnorm", activation="swiglu",
                      position_embedding="rope", bias=False)
    shapes = [tuple(p.shape) for n, p in _model(cfg).named_parameters() if is_hidden_matrix(n, tuple(p.shape))]
    for owners in (assign_owners(shapes, 4), bucket_owners(shapes, 4, MuonConfig().exchange_bucket_size)[1]):
        load = [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == rank) for rank in range(4)]
        assert len(shapes) == 4 * 7 and max(load) <= 1.25 * sum(load) / 4, load


def test_buckets_are_consecutive_runs_of_at_most_the_bucket_a_larger_matrix_alone():
    shapes = [(4, 5), (2, 5), (3, 3), (10, 10), (1, 1), (2, 2)]  # 20, 10, 9, 100, 1, 4 elements
    assert buckets(shapes, 30) == [[0, 1], [2], [3], [4, 5]]
    assert buckets(shapes, 39) == [[0, 1, 2], [3], [4, 5]]
    assert buckets(shapes, 0) == buckets(shapes, 1000) == [list(range(6))] and buckets([], 30) == []


class Matmuls(TorchDispatchMode):
    """`with Matmuls() as ran:` ... then ran.calls: the matrix products run (a GEMM call each on the
    CPU, a kernel launch on a GPU), and ran.largest: the most elements of an operand any of them read."""

    KERNELS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}

    def __init__(self):
        super().__init__()
        self.calls, self.largest = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.KERNELS:
            self.calls += 1
            self.largest = max([self.largest, *(a.numel() for a in args if isinstance(a, torch.Tensor))])
        return func(*args, **(kwargs or {}))


def test_matrices_of_one_shape_are_orthogonalised_as_one_stack_of_bounded_size(monkeypatch):
    """The matrices a rank steps whole iterate Newton-Schulz per batch of one shape, three products
    per iteration for the whole batch (one by one: for each matrix; at the bench's widths on the CPU
    the batches iterate up to twice as fast, to the same bits: the side-by-side test above), and no
    batch holds more than NS_BATCH_ELEMENTS elements: its stack's memory is bounded whatever the model."""
    o = _optim("spectral", True)
    model = _model(MODELS["gpt2"])  # 2 blocks: 8 projections of 32x32, 2 up_proj 48x32, 2 down_proj 32x48
    optimizer = build_optimizer(model, o)
    shapes = [tuple(p.shape) for p in optimizer.param_groups[0]["params"]]
    assert len(shapes) == 12 and len(set(shapes)) == 3
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    per_batch = 3 * o.muon.ns_steps  # X Xᵀ, the Gram polynomial, its product with X
    # the default bound takes each shape's matrices at once; one of three 32x32 matrices splits the
    # eight of them into batches of 3, 3 and 2 (and holds two 48x32 ones: one batch of each)
    for budget, batches in ((muon.NS_BATCH_ELEMENTS, 3), (3 * 32 * 32, 3 + 1 + 1)):
        monkeypatch.setattr(muon, "NS_BATCH_ELEMENTS", budget)
        model(ids[:, :-1], ids[:, 1:]).backward()
        with Matmuls() as ran:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert ran.calls == per_batch * batches, (budget, ran.calls)
        assert ran.largest <= budget
