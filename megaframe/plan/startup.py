"""What the trainer reports about memory: the planner's plan at start-up, and the model states each
rank really holds once the first step has allocated gradients and optimizer states."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout
from megaframe.plan.estimate import Estimate, estimate_config
from megaframe.parallel.dims import ParallelDims
from megaframe.plan.memory import GIB


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def memory_plan(cfg: TrainConfig, layout: Layout) -> Optional[Estimate]:
    """The planner's estimate for this run (None if it cannot be made, e.g. an unreadable tokenizer)."""
    try:
        return estimate_config(cfg, layout)
    except Exception:  # the plan is informative here; the run must not die of it
        return None


def plan_summary(est: Optional[Estimate]) -> str:
    """One line for the start-up summary."""
    if est is None:
        return "memory plan: unavailable"
    worst = next(s for s in est.stages if s.stage == est.peak_stage)
    return (f"memory plan per rank (pipeline stage {est.peak_stage}): weights {_size(worst.states.weights)} + grads "
            f"{_size(worst.states.gradients)} + optimizer {_size(worst.states.optimizer)} "
            f"(offloaded {_size(worst.states.host)}), activations {_size(worst.activations)}, "
            f"peak {_size(est.peak)} of {_size(est.capacity)} ({'fits' if est.fits_devices else 'DOES NOT FIT'})"
            + _host_part(est))


def _host_part(est: Estimate) -> str:
    """The node's RAM, where the run keeps something in it on purpose (plan/host.py)."""
    host = est.host
    if host is None or not (host.offloaded or host.async_copies or host.fast_tier):
        return ""
    of = f" of {_size(host.capacity)}" if host.capacity is not None else ""
    return f"; host memory per node {_size(host.peak)}{of} ({'fits' if host.fits else 'DOES NOT FIT'})"


def gather_model_states(mine: dict[str, int]) -> Optional[list[dict[str, int]]]:
    """Every rank's held model states (a few integers each), on rank 0, which reports them; None on
    the others (a collective). Gathered to one rank: to every rank it was world² records on the wire."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: Optional[list] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return everyone


def model_states_record(step: int, per_rank: list[dict[str, int]], est: Optional[Estimate],
                        grid: ParallelDims) -> dict:
    """The one-off metrics.jsonl record: measured bytes per rank next to the planner's per stage."""
    planned = {}
    if est is not None:
        planned = {str(s.stage): {"weights": s.states.weights, "gradients": s.states.gradients,
                                  "optimizer": s.states.optimizer, "host": s.states.host} for s in est.stages}
    stages = [grid.coords(rank).pp for rank in range(len(per_rank))]
    return {"step": step, "model_states_bytes_per_rank": per_rank, "pipeline_stage_per_rank": stages,
            "model_states_bytes_planned_per_stage": planned}


def _freed(held: dict[str, int]) -> str:
    """An engine that frees its gradients between steps (FSDP2) says what they take in the backward."""
    if "gradients_in_backward" not in held or held["gradients"]:
        return ""
    return f" (freed between steps; {_size(held['gradients_in_backward'])} in the backward)"


def model_states_line(per_rank: list[dict[str, int]], est: Optional[Estimate] = None) -> str:
    """Console line: rank 0's measured model states next to the ZeRO paper's (the planner's) for
    its stage, and the largest over ranks."""
    def total(r: dict) -> int:
        return r["weights"] + r["gradients"] + r["optimizer"]
    first, largest = per_rank[0], max(per_rank, key=total)
    paper = ""
    stage0 = next((s for s in est.stages if s.stage == 0), None) if est is not None else None
    if stage0 is not None:
        st = stage0.states
        paper = (f" (ZeRO paper: {_size(st.weights)} + {_size(st.gradients)} + {_size(st.optimizer)}"
                 f"{f', offloaded {_size(st.host)}' if st.host else ''})")
    return (f"model states held (measured after the first step), rank 0: weights {_size(first['weights'])} + "
            f"grads {_size(first['gradients'])}{_freed(first)} + optimizer {_size(first['optimizer'])}{paper}, reduce "
            f"bucket {_size(first['buckets'])}, other {_size(first['other'])}; largest rank "
            f"{_size(total(largest))}")
