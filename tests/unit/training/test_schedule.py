"""Learning-rate schedule values."""
from __future__ import annotations

import math

import pytest

from megaframe.config.schema import OptimConfig
from megaframe.training.schedule import LRFactor


def _lr(decay: str, step: int) -> float:
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, lr_decay=decay)
    return LRFactor(optim, max_steps=110)(step)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_linear_warmup(decay):
    assert [_lr(decay, s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])


def test_decays():
    assert _lr("cosine", 10) == pytest.approx(1.0)
    assert _lr("cosine", 60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert _lr("cosine", 110) == pytest.approx(0.1)
    assert _lr("linear", 60) == pytest.approx(0.55)
    assert _lr("linear", 500) == pytest.approx(0.1)  # past max_steps: stays at min_lr
    assert _lr("constant", 100) == 1.0


def documented_lr(lr: float, min_lr: float, warmup: int, max_steps: int, decay: str, applied: int) -> float:
    """docs/configuration.md's formula, written from the doc and not from schedule.py: the rate of
    a step after `applied` applied updates."""
    if applied < warmup:
        return lr * (applied + 1) / warmup
    if decay == "constant":
        return lr
    p = min(1.0, (applied - warmup) / max(1, max_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * p)) if decay == "cosine" else 1 - p
    return min_lr + (lr - min_lr) * shape


@pytest.mark.parametrize("decay, warmup, max_steps, skipped", [
    ("cosine", 3, 12, ()), ("linear", 0, 5, ()), ("constant", 4, 6, ()), ("cosine", 10, 10, ()),
    ("linear", 2, 9, (2, 5)),  # skipped steps do not advance the schedule
])
def test_the_schedule_is_the_documented_formula(decay, warmup, max_steps, skipped):
    """The lr each step trains at, as the plain and FSDP2 engines step the schedule (apply_update;
    DeepSpeed's engine steps the same LambdaLR on applied steps), against the doc's formula."""
    import torch

    from megaframe.backends.common import apply_update
    from megaframe.training.schedule import lr_scheduler_factory

    optim = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=warmup, lr_decay=decay)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=optim.lr)
    scheduler = lr_scheduler_factory(optim, max_steps)(optimizer)
    applied, trained, expected = 0, [], []
    for step in range(1, max_steps + 1):
        trained.append(optimizer.param_groups[0]["lr"])
        expected.append(documented_lr(optim.lr, optim.min_lr, warmup, max_steps, decay, applied))
        weight.grad = torch.ones(2)
        apply_update(optimizer, scheduler, [weight], norm=1.0, clip=0.0, applied=step not in skipped)
        applied += step not in skipped
    assert trained == pytest.approx(expected, rel=1e-12, abs=0)
    if decay != "constant" and 0 < warmup < max_steps and not skipped:
        assert trained[warmup - 1] == trained[warmup] == optim.lr  # the peak lasts two steps
        assert trained[-1] > optim.min_lr  # the last step trains above min_lr


def test_only_matrices_decay_in_every_model_flavour():
    """docs/configuration.md: weights, embeddings, experts and router decay; biases and norm gains
    do not. Judged here by the parameter's name, the code judges by its shape."""
    from megaframe.backends.common import decay_param_groups
    from megaframe.config.schema import ModelConfig, MoEConfig
    from megaframe.model.factory import build_model, resolve_dims
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    flavours = [ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16),
                ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                            seq_length=16, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                            tie_embeddings=False, qk_norm=True, bias=True),
                ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                            moe=MoEConfig(num_experts=4, top_k=2))]
    for cfg in flavours:
        model = build_model(resolve_dims(cfg, 64), ParallelState(ParallelDims(), rank=0), seed=0)
        groups = {g["name"]: {id(p) for p in g["params"]} for g in decay_param_groups(model, 0.1)}
        for name, param in model.named_parameters():
            undecayed = name.endswith("bias") or "norm" in name
            assert (id(param) in groups["no_decay"]) == undecayed, (cfg.arch, name)
            assert (id(param) in groups["decay"]) != undecayed, (cfg.arch, name)
