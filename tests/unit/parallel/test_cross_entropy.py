"""The loss at one TP rank (parallel/cross_entropy.py): torch's own mean bitwise where targets count,
and a finite zero, not NaN, where none does. Under data.eod_mask_loss every target whose input is an
end-of-document token is left out, so a run of empty documents (a filtered corpus holds them) fills
a whole micro-batch, or a context-parallel shard, with left-out targets; torch's mean is 0/0 there,
and one NaN gradient poisons the step (the TP > 1 path already divided by a clamped count)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaframe.config.schema import ModelConfig
from megaframe.data.dataset import IGNORED_TARGET
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.cross_entropy import vocab_parallel_cross_entropy
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.layers import TPGroup
from megaframe.parallel.state import ParallelState

VOCAB, PADDED = 13, 16


def _logits_and_targets(left_out: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 40, PADDED, generator=g)
    targets = torch.randint(0, VOCAB, (3, 40), generator=g)
    targets[torch.rand(3, 40, generator=g) < left_out] = IGNORED_TARGET
    return logits, targets


@pytest.mark.parametrize("left_out", [0.0, 0.3, 0.97])
def test_one_rank_is_torchs_own_mean_bitwise(left_out):
    logits, targets = _logits_and_targets(left_out)
    ours_in, torch_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = vocab_parallel_cross_entropy(ours_in, targets, TPGroup(), 0, VOCAB)
    expected = F.cross_entropy(torch_in[..., :VOCAB].reshape(-1, VOCAB), targets.reshape(-1),
                               ignore_index=IGNORED_TARGET)
    ours.backward()
    expected.backward()
    assert torch.equal(ours, expected)
    assert torch.equal(ours_in.grad, torch_in.grad)


def test_no_counted_target_is_a_zero_loss_with_zero_gradients():
    logits, targets = _logits_and_targets(0.0)
    targets.fill_(IGNORED_TARGET)
    logits.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, targets, TPGroup(), 0, VOCAB)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0


def test_a_micro_batch_of_empty_documents_leaves_the_step_finite():
    """The model's step loss under data.eod_mask_loss, weighed as a step weighs it (StepTargets): a
    micro-batch whose inputs are all end-of-document tokens adds nothing, its gradients are zeros."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
    dims = resolve_dims(cfg, 100)
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=7)
    inputs = torch.full((2, 16), 5)  # every input an end of document: every target left out
    targets = torch.full((2, 16), IGNORED_TARGET)
    model.step_targets.factor = torch.tensor(2 / 24, dtype=torch.float64)  # the global batch counts 24
    loss = model(inputs, targets)
    loss.backward()
    assert loss.item() == 0.0
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name


def test_a_global_batch_without_a_counted_target_is_a_nan_the_guard_skips():
    """Not a zero loss: a zero loss with zero gradients would still be an applied step (AdamW's
    momentum and weight decay move the weights, the schedule advances) on nothing learned. With a
    counted target anywhere in the step, the empty micro-batch adds 0 (above)."""
    from megaframe.backends.common import counting_targets
    from megaframe.model.masking import StepTargets

    holder = StepTargets()
    empty = [(torch.full((2, 16), 5), torch.full((2, 16), IGNORED_TARGET))] * 2
    with counting_targets(holder, empty, ParallelState(ParallelDims(), rank=0)):
        weighed = holder.weigh(torch.tensor(0.0), empty[0][1])
    assert torch.isnan(weighed)
    counted = [empty[0], (torch.full((2, 16), 3), torch.full((2, 16), 3))]
    with counting_targets(holder, counted, ParallelState(ParallelDims(), rank=0)):
        assert holder.weigh(torch.tensor(0.0), counted[0][1]).item() == 0.0
        assert holder.weigh(torch.tensor(2.0), counted[1][1]).item() == 4.0  # 32 of 32 targets, 2 micro-batches
