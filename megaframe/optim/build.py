"""The optimizer every engine steps with, built from `optim` (OptimConfig) in one place: the plain
and FSDP2 engines take the optimizer; DeepSpeed takes the groups for its own AdamW (from ds_config),
or Muon as its client optimizer (backends/deepspeed/muon_zero.py)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megaframe.config.schema import OptimConfig
from megaframe.optim.groups import Shape, decay_param_groups, full_shape, muon_param_groups
from megaframe.optim.muon import Muon


def param_groups(model: torch.nn.Module, optim: OptimConfig, shape: Shape = full_shape,
                 stepped_by: str = "adamw") -> list[dict]:
    """The parameter groups of optim.name's optimizer, for an engine whose own optimizer is
    `stepped_by` (DeepSpeed's AdamW): another optim.name is refused (optim/rules.py refuses it before
    launch; this keeps a caller that skipped that rule from stepping Muon's groups with AdamW).
    shape: a parameter's full shape, where the engine has already partitioned it away."""
    if optim.name != stepped_by:
        raise ValueError(f"optim.name={optim.name}: this engine steps {stepped_by} only; use backend=fsdp2")
    if optim.name == "muon":
        return muon_param_groups(model, optim, shape)
    return decay_param_groups(model, optim.weight_decay, shape)


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, fused: bool = True, ps=None,
                    shape: Shape = full_shape, described: bool = False,
                    split_groups: Optional[Callable[[list[dict]], list[dict]]] = None) -> torch.optim.Optimizer:
    """optim.name's optimizer over the model's parameters. AdamW: torch's, fused (one kernel per step
    on a GPU; torch's fused CPU kernel on the host, which DeepSpeed's ZeRO-0 uses too). ps: the
    ParallelState, which Muon assembles tensor-parallel matrices with (build it on every rank at once).
    shape: a parameter's full shape, where the engine has already partitioned it away (ZeRO-3).
    described: Muon's matrices lie in flat partitions the engine describes after (DeepSpeed ZeRO's).
    split_groups: how the engine wants the groups cut (DeepSpeed: each group's experts in a group of
    their own, partitioned over their expert-data-parallel ranks)."""
    if optim.name == "muon":
        m = optim.muon
        groups = muon_param_groups(model, optim, shape)
        return Muon(split_groups(groups) if split_groups else groups, momentum=m.momentum, nesterov=m.nesterov,
                    ns_coefficients=tuple(m.ns_coefficients), ns_steps=m.ns_steps, eps=m.eps, adjust_lr=m.adjust_lr,
                    betas=tuple(optim.betas), adamw_eps=optim.eps, fused=fused, ps=ps, shape=shape,
                    described=described, exchange_bucket_size=m.exchange_bucket_size)
    return torch.optim.AdamW(decay_param_groups(model, optim.weight_decay), lr=optim.lr, betas=tuple(optim.betas),
                             eps=optim.eps, weight_decay=optim.weight_decay, fused=fused)
