"""The launcher plug: how the ranks of a checked job start. One module per launcher, each with
`start(job)` (the exit code to end this process with, or None once it ran the job here),
`host_problem(cfg)` (what this host lacks for it, in one line, or None: checked before launch) and
`waits(job)` (whether this process goes on to wait for ranks or jobs it started, rather than train).

- local: this host: one process, or ranks under torch's elastic agent in this process; elastic
  (launcher.min_nodes): the torchrun line every node runs.
- torchrun: an external launcher (torchrun, srun's tasks, Ray's workers, local's own agent) has
  started this process as one rank of the job.
- slurm: an sbatch script, submitted (or written: launcher.dry_run); elastic: one agent a node.
- ray: Ray Train's workers, one a rank; elastic: a worker range.
A new launcher is one module and one line in LAUNCHERS (and its name among launcher.name's choices,
config/launcher_rules.py)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

from omegaconf import DictConfig

from megaframe.config.schema import TrainConfig
from megaframe.config.validate import Layout
from megaframe.launch.base import launcher_world_size

LAUNCHERS = {"local": "megaframe.launch.local", "torchrun": "megaframe.launch.torchrun",
             "slurm": "megaframe.launch.slurm", "ray": "megaframe.launch.ray"}


@dataclass
class Job:
    """A checked job: its config and layout, the overrides its ranks get (which a launcher may
    extend: the run dir it pins), its run dir, and Hydra's composition of `composed_args`."""

    cfg: TrainConfig
    layout: Layout
    run_dir: str
    composed: DictConfig
    args: list[str] = field(default_factory=list)
    composed_args: list[str] = field(default_factory=list)

    @property
    def elastic(self) -> bool:
        """launcher.min_nodes: the job is a node range, started by this process (not one of its ranks)."""
        return launcher_world_size() is None and self.cfg.launcher.min_nodes is not None


def launcher(name: str) -> ModuleType:
    """The launcher module named `name` (a key of LAUNCHERS)."""
    return importlib.import_module(LAUNCHERS[name])


def launcher_for(cfg: TrainConfig) -> ModuleType:
    """What starts this job from here: torchrun's part when a launcher started this process as a rank
    (WORLD_SIZE set), else the configured one."""
    return launcher("torchrun" if launcher_world_size() is not None else cfg.launcher.name)
