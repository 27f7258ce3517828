"""The model as one layout-free state dict, and back: canonical names, full (unsharded) fp32
tensors, the vocabulary unpadded.

Canonical names are the parameter names of the non-pipelined tp=1 GPT (ModelSpec). A tensor-
parallel shard carries its ShardSpec (layers.mark_shard), which takes a rank's piece out of the
full tensor and gathers the pieces back. The vocabulary rows (token embedding, untied head) are
padded to a multiple of make_vocab_size_divisible_by * tp, so the padding depends on the layout
and is never stored.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megaframe.model.spec import VOCAB_PARAMS, ModelSpec


class StateMismatch(ValueError):
    """A full state dict that does not fit the model; str(err) is a single line."""


@torch.no_grad()
def full_state_dict(model: nn.Module, vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """{canonical name: full fp32 tensor} of a non-pipelined GPT, gathering tensor-parallel shards
    (a collective over the model's TP group when it is split: every TP rank must call this).
    Vocabulary rows are cut to vocab_size (default: the model's dims.vocab_size)."""
    if vocab_size is None:
        vocab_size = model.dims.vocab_size
    tp_group = getattr(getattr(model, "tp", None), "group", None)
    full = {}
    for name, param in model.named_parameters():
        value = param.detach().float()
        if getattr(param, "partition_count", 1) > 1:
            value = param.shard.gather(value, tp_group, param.partition_count)
        if name in VOCAB_PARAMS:
            value = value[:vocab_size]
        full[name] = value.clone()
    return full


@torch.no_grad()
def load_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict into a (possibly tensor-parallel) GPT: pad vocabulary rows with zeros,
    keep this rank's slice of each sharded parameter. Raises StateMismatch naming the first misfit."""
    own = dict(model.named_parameters())
    missing, unexpected = sorted(own.keys() - full.keys()), sorted(full.keys() - own.keys())
    if missing or unexpected:
        raise StateMismatch(f"checkpoint tensors do not match the model: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}; check the model config against the checkpoint's")
    for name, param in own.items():
        value = full[name].to(torch.float32)
        want = tuple(getattr(param, "partition_shape", param.shape))
        if name in VOCAB_PARAMS and value.shape[0] <= want[0] and tuple(value.shape[1:]) == want[1:]:
            value = torch.cat([value, value.new_zeros(want[0] - value.shape[0], *want[1:])])
        if tuple(value.shape) != want:
            raise StateMismatch(f"checkpoint tensor {name} has shape {list(full[name].shape)} but the model "
                                f"expects {list(want)}; check the model config against the checkpoint's")
        if getattr(param, "partition_count", 1) > 1:
            value = param.shard.take(value, param.partition_index, param.partition_count)
        param.copy_(value.to(param.dtype))


def canonical_shapes(dims) -> dict[str, tuple[int, ...]]:
    """{canonical name: full shape, vocabulary unpadded} of the GPT for these GPTDims."""
    return {name: spec.shape for name, spec in ModelSpec(dims).parameters.items()}
