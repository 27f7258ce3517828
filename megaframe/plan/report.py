"""The planner's output: a readable table, JSON, and the one-line verdict megaframe-train prints."""
from __future__ import annotations

import json
from typing import Optional

from megaframe.plan.estimate import Estimate
from megaframe.plan.host import HostMemory
from megaframe.plan.memory import GIB


# comm_bytes keys whose upper-cased name would not say what they are
COMM_LABELS = {"dp_replicas": "DP across HSDP replicas", "edp": "DP of experts", "optimizer": "OPTIMIZER"}


def gib(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:,.0f}"


def _seconds(value: Optional[float]) -> str:
    return "n/a (set cluster.peak_tflops)" if value is None else f"{value:,.2f} s"


def _extra_flops(est: Estimate) -> str:
    """What the step time counts beyond bf16 model FLOPs, where a run has it: the fp8 share (at the
    fp8 peak), the optimizer's Newton-Schulz FLOPs per rank."""
    extra = f" ({est.fp8_flops_per_step:.3e} in fp8)" if est.fp8_flops_per_step else ""
    return extra + (f" + {est.optimizer_flops_per_rank:.3e} Newton-Schulz FLOPs per rank"
                    if est.optimizer_flops_per_rank else "")


def verdict(est: Estimate) -> str:
    """'fits' or 'does not fit', with the numbers."""
    word = "fits" if est.fits_devices else "does NOT fit"
    line = (f"{est.layout.describe()} {word} on {est.cluster}: peak {gib(est.peak)} (pipeline stage {est.peak_stage}) "
            f"vs {gib(est.capacity)} per device, margin {gib(est.margin)}")
    if est.host is not None and not est.host.fits:
        line += f"; {'but ' if est.fits_devices else ''}NOT the host memory: {host_line(est.host)}"
    return line


def host_terms(host: HostMemory) -> str:
    """The host memory terms a rank has (plan/host.py), named by the setting that puts them there."""
    named = {"its device's memory (cluster=local)": host.device_in_ram, "offload=cpu states": host.offloaded,
             "train.async_save copies": host.async_copies, "train.fast_save_interval parts": host.fast_tier}
    return " + ".join(f"{name} {gib(value)}" for name, value in named.items() if value)


def host_line(host: HostMemory) -> str:
    """Per node: what the ranks keep in RAM against what it has."""
    capacity = gib(host.capacity) if host.capacity is not None else "unknown (set cluster.host_memory_gb)"
    return (f"{host.ranks} rank{'s' if host.ranks > 1 else ''} x ({host_terms(host)}) = {gib(host.peak)} vs "
            f"{capacity} per node")


def table(est: Estimate, mfu: float, alternatives: list[Estimate] | None = None, auto: Optional[Estimate] = None) -> str:
    """The report megaframe-plan prints."""
    lay = est.layout
    active = est.active_parameters
    sparse = (f", {_count(active)} active per token ({active:,})"
              if active and active != est.total_parameters else "")
    lines = [f"megaframe-plan: {_count(est.total_parameters)} parameters ({est.total_parameters:,}){sparse} on "
             f"{lay.world_size} devices, cluster {est.cluster}",
             f"layout: {lay.describe()} | micro-batch {lay.micro_batch_size}, global batch {lay.global_batch_size}, "
             f"{lay.micro_batches} micro-batch(es) per step",
             "",
             f"{'stage':>5} {'blocks':>6} {'params/rank':>14} {'weights':>12} {'grads':>12} {'optimizer':>12} "
             f"{'offloaded':>12} {'act/micro':>12} {'in flight':>9} {'activations':>12} {'working':>12} {'peak':>12}"]
    for s in est.stages:
        lines.append(f"{s.stage:>5} {s.blocks:>6} {s.parameters:>14,} {gib(s.states.weights):>12} "
                     f"{gib(s.states.gradients):>12} {gib(s.states.optimizer):>12} {gib(s.states.host):>12} "
                     f"{gib(s.activations_per_micro_batch):>12} {s.in_flight:>9} {gib(s.activations):>12} "
                     f"{gib(s.working):>12} {gib(s.peak):>12}")
    lines += ["",
              f"peak {gib(est.peak)} (pipeline stage {est.peak_stage}, incl. {gib(est.reserved)} "
              f"reserved) vs {gib(est.capacity)} per device: {'FITS' if est.fits_devices else 'DOES NOT FIT'}, "
              f"margin {gib(est.margin)}",
              f"per step: {est.flops_per_step:.3e} model FLOPs{_extra_flops(est)}, {est.tokens_per_step:,} tokens; "
              f"step time at {mfu:.0%} MFU {_seconds(est.step_time_s)}",
              "communication per rank per step: " + ", ".join(f"{COMM_LABELS.get(k, k.upper())} {gib(v)}"
                                                               for k, v in est.comm_bytes.items())]
    if est.host is not None and est.host.per_rank and (est.host.offloaded or est.host.async_copies
                                                       or est.host.fast_tier or not est.host.fits):
        lines.append(f"host memory: {host_line(est.host)}: {'FITS' if est.host.fits else 'DOES NOT FIT'}")
    if step := max(s.step_working for s in est.stages):  # Muon: its exchange buffers, once activations are freed
        lines.append(f"optimizer step: {gib(step)} transient after the backward (the peak counts the larger of "
                     f"this and activations + working)")
    if alternatives is not None:
        lines += ["", "layouts that fit, fastest first (estimated step time with bubble, recompute and exposed comm):"]
        if not alternatives:
            lines.append("  none: more devices (launcher.nodes), a smaller micro-batch or offload to NVMe are left")
        for i, alt in enumerate(alternatives, 1):
            lines.append(f"  {i:>2}. {alt.layout.describe():<70} peak {gib(alt.peak):>12}  step ~{alt.ranked_step_time_s:,.2f} s")
    if auto is not None:
        lines += ["", f"parallel=auto picks: {auto.layout.describe()}"]
    return "\n".join(lines)


def as_json(est: Estimate, mfu: float, alternatives: list[Estimate] | None = None,
            auto: Optional[Estimate] = None, dry_run: Optional[dict] = None) -> str:
    """The same content as table(), machine-readable."""
    data = {"plan": est.to_dict(), "mfu": mfu, "verdict": verdict(est)}
    if dry_run is not None:
        data["dry_run"] = dry_run
    if alternatives is not None:
        data["alternatives"] = [alt.to_dict() for alt in alternatives]
    if auto is not None:
        data["auto"] = auto.to_dict()
    return json.dumps(data, indent=2)
