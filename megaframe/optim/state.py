"""An optimizer's per-parameter state by name (table.py): made before the first step where a
checkpoint needs it, listed per parameter for the layout-free format, and matched against the
optimizer a checkpoint records."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from megaframe.optim.table import COUNTS_STEPS, DEFAULT, group_optimizer, state_keys

# Not "optimizer": DeepSpeed's own checkpoint merges the client state into its state dict, whose
# "optimizer" is the engine's optimizer state_dict; a record under that key replaced it, and a
# DeepSpeed-native resume failed with KeyError: 'param_groups'.
RECORD_KEY = "optimizer_record"


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The name a checkpoint records for this optimizer (torch's AdamW: "adamw")."""
    return getattr(optimizer, "megaframe_name", DEFAULT)


def saved_optimizer(state: Mapping[str, Any]) -> str:
    """The optimizer a checkpoint's state records; one written before the record: AdamW's."""
    record = state.get(RECORD_KEY)
    name = record.get("name") if isinstance(record, dict) else None
    return name if isinstance(name, str) else DEFAULT


def same_optimizer(state: Mapping[str, Any], name: str) -> bool:
    """Whether a checkpoint's optimizer tensors are optimizer `name`'s (else its state starts fresh:
    a switch train.resume_accept_optimizer_change accepted before any tensor was read)."""
    return saved_optimizer(state) == name


def state_keys_by_param(optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> the names of its state tensors, each shaped like it."""
    return {id(p): state_keys(group) for group in optimizer.param_groups for p in group["params"]}


def step_tensor(step: int, param: torch.Tensor, in_kernel: bool) -> torch.Tensor:
    """Adam's step count as torch keeps it: fused and capturable AdamW read it from the parameter's
    device inside their kernel (a host tensor there is an illegal access on CUDA), the others from
    the host (torch's Optimizer.load_state_dict places it the same way). in_kernel: fused or capturable."""
    if in_kernel:
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step))


def _step_counts_differ(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step counts are not all equal: host counts compared on the host, counts
    on the device in one read (their smallest and largest)."""
    counts = [state["step"] for state in optimizer.state.values() if isinstance(state.get("step"), torch.Tensor)]
    distinct = {float(count) for count in counts if count.device.type == "cpu"}
    on_device = [count.reshape(()) for count in counts if count.device.type != "cpu"]
    if on_device:
        smallest, largest = torch.aminmax(torch.stack(on_device).float())
        distinct.update(torch.stack([smallest, largest]).tolist())
    return len(distinct) > 1


def ensure_state(optimizer: torch.optim.Optimizer, step: int, reset_steps: bool = True) -> None:
    """State exists only after a parameter's first applied step: made here (zeros, and a step count
    of `step` where the optimizer keeps one) so a checkpoint saved before it, or a resume into it,
    has tensors to write and read. reset_steps (a resume): every step count becomes `step`. Else (a
    save) only missing ones are made, unless the counts differ (a parameter without a gradient in
    some step was not stepped): then every count becomes `step`, the one count the checkpoint keeps,
    so the run goes on as a resume from it would. Making every count anew at each save was a
    host-to-device copy the host waited for, per parameter. A sharded parameter (a DTensor) keeps its
    step where its local shard lives."""
    reset_steps = reset_steps or _step_counts_differ(optimizer)
    for group in optimizer.param_groups:
        kind = group_optimizer(group)
        in_kernel = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state[p]
            for key in state_keys(group):
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if COUNTS_STEPS[kind] and (reset_steps or "step" not in state):
                state["step"] = step_tensor(step, p.to_local() if hasattr(p, "to_local") else p, in_kernel)
