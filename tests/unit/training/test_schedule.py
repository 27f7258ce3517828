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
