"""Parameter groups: which parameters each optimizer steps, with which learning rate and decay,
judged by each parameter's canonical name and full shape whatever the layout."""
from __future__ import annotations

from typing import Callable

import torch

Shape = Callable[[torch.nn.Parameter], torch.Size]


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    return p.shape


def decay_param_groups(model: torch.nn.Module, weight_decay: float, shape: Shape = full_shape) -> list[dict]:
    """Weight decay on matrices only; biases and norm gains are not decayed (as Megatron does).
    shape: a parameter's full shape, where the engine has already partitioned it away."""
    def matrix(p) -> bool:
        return len(shape(p)) >= 2
    decay = [p for p in model.parameters() if p.requires_grad and matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not matrix(p)]
    # named: DeepSpeed splits each group's experts into a group of their own by this name (MoE)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def is_hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Whether Muon steps this parameter: an attention or MLP projection's weight (2D), or a stack of
    experts' projections (3D, one matrix per expert). Embeddings, the LM head and the router (a
    matrix, but one row of logits per expert) step by AdamW with the norms and biases."""
    return (len(shape) == 2 and name.endswith("_proj.weight")) or (len(shape) == 3 and name.endswith("_proj"))


def muon_param_groups(model: torch.nn.Module, optim, shape: Shape = full_shape) -> list[dict]:
    """optim=muon's groups (optim: OptimConfig): the hidden matrices at optim.lr and
    optim.weight_decay; the rest AdamW's at optim.muon.adamw_lr / adamw_weight_decay, biases and
    norm gains undecayed."""
    m = optim.muon
    adamw_lr = optim.lr if m.adamw_lr is None else m.adamw_lr
    adamw_decay = optim.weight_decay if m.adamw_weight_decay is None else m.adamw_weight_decay
    matrices, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = tuple(shape(p))
        (matrices if is_hidden_matrix(name, full) else decay if len(full) >= 2 else no_decay).append(p)
    return [{"params": matrices, "optimizer": "muon", "name": "muon", "lr": optim.lr,
             "weight_decay": optim.weight_decay},
            {"params": decay, "optimizer": "adamw", "name": "decay", "lr": adamw_lr, "weight_decay": adamw_decay},
            {"params": no_decay, "optimizer": "adamw", "name": "no_decay", "lr": adamw_lr, "weight_decay": 0.0}]
