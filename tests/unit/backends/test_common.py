"""The parts of a backend every engine shares (backends/common.py), without processes."""
from __future__ import annotations

import torch

from megaframe.backends.common import decay_param_groups, on_device


def test_only_matrices_decay_judged_by_their_full_shape():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    groups = {g["name"]: g for g in decay_param_groups(model, 0.1)}
    assert [p.shape for p in groups["decay"]["params"]] == [torch.Size([3, 4])]
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert len(groups["no_decay"]["params"]) == 3  # the bias, the norm's gain and bias
    # an engine that partitioned a weight away (empty here) says its full shape
    model[0].weight.data = torch.empty(0)
    full = {id(model[0].weight): torch.Size([3, 4])}
    groups = {g["name"]: g for g in decay_param_groups(model, 0.1, lambda p: full.get(id(p), p.shape))}
    assert groups["decay"]["params"] == [model[0].weight]


def test_batches_already_on_the_device_are_not_copied():
    batch = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    ((inputs, targets),) = on_device([batch], torch.device("cpu"))
    assert inputs is batch[0] and targets is batch[1]
