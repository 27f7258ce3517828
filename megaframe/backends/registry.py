"""The one place that imports a concrete engine: the trainer, the CLI, the planner and the dry run
ask for one by name and get its plug (what the rest of megaframe needs from an engine). A second
engine is a sibling folder with a plug.py and one line in ENGINES."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from megaframe.backends.facts import EngineFacts
from megaframe.config.fp8_rules import cuda_capability
from megaframe.config.schema import OffloadConfig, TrainConfig
from megaframe.config.validate import ConfigError, Layout, validate
from megaframe.optim.rules import optim_layout_problem

DEFAULT = "deepspeed"
ENGINES = {"deepspeed": "megaframe.backends.deepspeed.plug",  # name -> module holding its PLUG
           "fsdp2": "megaframe.backends.fsdp2.plug"}
PLAIN = "megaframe.backends.plain.plug"  # what runs a one-process run DeepSpeed's engine adds nothing to


@dataclass(frozen=True)
class EnginePlug:
    """An engine as megaframe uses it. Each callable imports the engine library on first use, so
    asking for a plug (and refusing a bad config) costs no import of DeepSpeed or its peers."""

    name: str
    build: Callable[..., Any]  # (cfg, layout, ps, dims, lr_scheduler) -> a Backend (backends/__init__.py)
    # this rank's device and process group: (collective_timeout_s, join_timeout_s) (parallel/rendezvous.py)
    init_distributed: Callable[[Optional[float], Optional[float]], None]
    device_type: Callable[[], str]  # "cuda" or "cpu": what this rank trains on (after init_distributed)
    device_supports_fp16: Callable[[], bool]
    device_supports_bf16: Callable[[], bool]
    system_problem: Callable[[OffloadConfig, float], Optional[str]]  # offload's needs on this machine
    expert_parallel_problem: Callable[[int, int], Optional[str]]  # (zero stage, ep)
    stage_boundaries: Callable[[tuple, int], tuple]  # where the engine cuts these layer weights into pp stages
    config_problem: Callable[[TrainConfig], Optional[str]]  # the engine's own rules, for validate()
    layout_problem: Callable[[TrainConfig, Layout], Optional[str]]  # its rules on the resolved layout
    config_warnings: Callable[[TrainConfig, Layout], list[str]]  # legal, but the engine will not do all asked
    # (dims, grid, rank, partition, schedule, virtual_stages) -> MetaStages: rank's stages built on the meta device
    meta_stages: Callable[..., Any]
    facts: EngineFacts  # what the planner and validation read of it (backends/facts.py)


def _on_call(folder: str, entry: str) -> Callable[..., Any]:
    """The function named "module:function" within megaframe/backends/FOLDER/, imported when first called."""
    module, function = entry.split(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(f"megaframe.backends.{folder}.{module}"), function)(*args, **kwargs)
    return call


def lazy_plug(name: str, facts: EngineFacts, **entries: str) -> EnginePlug:
    """The plug of engine `name` whose every entry, given as "module:function" within
    megaframe/backends/NAME/, imports that module when first called: asking for a plug (and refusing
    a bad config) imports no engine library."""
    return EnginePlug(name=name, facts=facts, **{key: _on_call(name, entry) for key, entry in entries.items()})


def validate_for_engine(cfg: TrainConfig, world_size: int, ask_bf16: bool = True) -> Layout:
    """validate() with the configured engine's (backend.name) rules and device checks; ask_bf16:
    whether this machine's device decides bf16 (not where the planner runs, away from the GPUs)."""
    plug = engine(cfg.backend.name)
    for name in cfg.plan.engines:
        if name not in ENGINES:
            raise ConfigError(f"plan.engines holds {name!r}, which is not an engine megaframe has; list some of "
                              f"{', '.join(sorted(ENGINES))}, e.g. plan.engines=[deepspeed,fsdp2]")
    # the optimizer's layout rule (optim/rules.py) before the engine's: which layouts it steps correctly
    return validate(cfg, world_size, plug.device_supports_fp16, plug.device_supports_bf16 if ask_bf16 else None,
                    plug.config_problem,
                    lambda c, lay: _optim_problem(c, lay, plug.facts) or plug.layout_problem(c, lay),
                    plug.facts.per_module_gather_stages,
                    (lambda: cuda_capability(plug.device_type())) if ask_bf16 else None)


def optim_refuses(cfg: TrainConfig, lay) -> Optional[str]:
    """The optimizer's layout rule (optim/rules.py) on a candidate of the planner's search (a
    PlanLayout: its engine, ZeRO stage and offload in place of cfg's), so parallel=auto never
    proposes a layout validation would then refuse."""
    cand = replace(cfg, backend=replace(cfg.backend, name=lay.engine), zero=replace(cfg.zero, stage=lay.zero_stage),
                   offload=replace(cfg.offload, optimizer=lay.offload_optimizer, param=lay.offload_param))
    return _optim_problem(cand, lay, engine_facts(lay.engine))


def _optim_problem(cfg: TrainConfig, lay, facts: EngineFacts) -> Optional[str]:
    """optim/rules.py's rule for a run of this engine: the optimizer steps whole tensors where the
    engine hands them (or the plain engine stands in), described partitions at the stages it names."""
    return optim_layout_problem(cfg, facts.optimizer_on_tensors or runs_plain(cfg, lay.world_size),
                                facts.described_partition_stages)


def runs_plain(cfg: TrainConfig, world_size: int) -> bool:
    """Whether DeepSpeed's engine would add nothing to this run but its import and bookkeeping: one
    process, ZeRO-0, fp32, nothing offloaded, layout-free checkpoints only, on the CPU or CUDA (an
    accelerator DeepSpeed names otherwise stays DeepSpeed's). backend.plain_one_process=false opts out."""
    return (cfg.backend.name == "deepspeed" and cfg.backend.plain_one_process and world_size == 1
            and cfg.zero.stage == 0 and cfg.precision.dtype == "fp32"
            and cfg.offload.optimizer == "none" and cfg.offload.param == "none"
            and cfg.train.universal_checkpoint and not cfg.train.native_checkpoint
            and os.environ.get("DS_ACCELERATOR", "") in ("", "cpu", "cuda"))


def run_engine(cfg: TrainConfig, world_size: int) -> EnginePlug:
    """The plug that builds and steps this run: the configured engine's, or, where runs_plain(), the
    plain one-process engine (backends/plain/: torch alone, DeepSpeed's step bit for bit) under the
    configured engine's rules and facts, which validated and planned the run."""
    named = engine(cfg.backend.name)
    if not runs_plain(cfg, world_size):
        return named
    entries = importlib.import_module(PLAIN).RUNS
    return replace(named, name="plain", **{key: _on_call("plain", entry) for key, entry in entries.items()})


def engine_said(cfg: TrainConfig, ran: str) -> str:
    """What the start-up line says of the engine that stepped the run (`ran`, run_engine's name):
    backend=NAME, and where the plain engine stood in for the one named, that it did and how to
    run the named one, so that no one benchmarks or debugs DeepSpeed believing it ran."""
    if ran == cfg.backend.name:
        return f"backend={ran}"
    return f"backend={cfg.backend.name} {importlib.import_module(PLAIN).SAID}"


def engine_facts(name: str) -> EngineFacts:
    """The named engine's facts (backends/facts.py); ConfigError for an unknown name, as engine()."""
    return engine(name).facts


def engine(name: str = DEFAULT) -> EnginePlug:
    """The named engine's plug; ConfigError (a ValueError) naming the key for an unknown name."""
    if name not in ENGINES:
        raise ConfigError(f"backend.name={name!r} is not an engine megaframe has; choose "
                          f"{' or '.join(f'backend={known}' for known in sorted(ENGINES))}")
    return importlib.import_module(ENGINES[name]).PLUG
