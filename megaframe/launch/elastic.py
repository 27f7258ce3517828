"""Elastic jobs: `launcher.min_nodes` lets a job lose nodes and go on at a smaller data-parallel
size, and grow back when nodes join, with no step lost or repeated.

What makes a resize exact is already there: each attempt resumes from the newest layout-free
checkpoint (which loads into any dp), and step k's samples depend only on (seed, k, global batch).
What this module adds is the launch and the checks before it:

- torchrun's elastic agent per node (`--nnodes=MIN:MAX`, c10d rendezvous). With torch 2.13's
  default, the rendezvous TCP store is shared with the workers, and a node joining a running job
  hangs (the agents time out waiting for `role_info`/`MASTER_ADDR`: restart counts differ across
  nodes, survivors at 1 and a newcomer at 0, so no per-attempt key prefix can line them up).
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every rendezvous round its own store; every line
  written here sets it.
- Every world size the range allows must resolve a layout and fit, before launch: a size that
  cannot would crash-loop at the moment a node is lost.
- A deterministic failure is recorded in the run directory, keyed by the job's rendezvous id
  (TORCHELASTIC_RUN_ID), where every node and attempt reads it (stop_file()): without a shared
  agent store there is nowhere else every node sees.

Limits (torchrun's, not ours): the node that hosts the c10d rendezvous (launcher.rdzv_endpoint) must
survive, and the in-flight step since the last checkpoint is redone (so train.save_interval sets how
much work a lost node costs).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Callable, Optional

from megaframe.config.launcher_rules import DEFAULT_RDZV_PORT
from megaframe.config.schema import LauncherConfig, TrainConfig

STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # =1: a fresh store per rendezvous round (see above)
NODE_SCRIPT = "elastic_node.sh"  # RUN_DIR/elastic_node.sh: launcher=local writes the per-node command there


def is_elastic(launcher: LauncherConfig) -> bool:
    return launcher.min_nodes is not None


def world_sizes(launcher: LauncherConfig, per_node: int) -> list[int]:
    """Every world size the job may run at. torchrun and SLURM add and remove whole nodes of
    per_node ranks (cluster.gpus_per_node); Ray places workers one at a time, so any count between
    the bounds."""
    if launcher.name == "ray":
        return list(range(launcher.min_nodes * per_node, launcher.nodes * per_node + 1))
    return [nodes * per_node for nodes in range(launcher.min_nodes, launcher.nodes + 1)]


def range_problem(cfg: TrainConfig, layout_at: Callable[[TrainConfig, int], object],
                  fit_problem: Callable[[TrainConfig, object], Optional[str]]) -> Optional[str]:
    """One line naming every world size of the range that cannot train, or None. layout_at(cfg,
    world) validates a config at that world (raising ConfigError with the reason); fit_problem(cfg,
    layout) says why the planner finds it does not fit, or None. The fixes it offers are checked
    the same way: only those under which every size trains are named."""
    failing = _failing_worlds(cfg, layout_at, fit_problem)
    if not failing:
        return None
    launcher = cfg.launcher
    first_world, first_why = next(iter(failing.items()))
    sizes = ", ".join(str(w) for w in failing)
    return (f"launcher.min_nodes={launcher.min_nodes} launcher.nodes={launcher.nodes}: the job cannot train at "
            f"world size {sizes} of {world_sizes(launcher, cfg.cluster.gpus_per_node)}; at {first_world}: {first_why}; "
            f"{_fixes(cfg, set(failing), layout_at, fit_problem)}")


def _failing_worlds(cfg: TrainConfig, layout_at, fit_problem) -> dict[int, str]:
    from megaframe.config.validate import ConfigError

    failing: dict[int, str] = {}
    for world in world_sizes(cfg.launcher, cfg.cluster.gpus_per_node):
        try:
            why = fit_problem(cfg, layout_at(cfg, world))
        except ConfigError as err:
            why = str(err)
        if why:
            failing[world] = why
    return failing


def _fixes(cfg: TrainConfig, failing: set[int], layout_at, fit_problem) -> str:
    """The widest run of node counts in the range at which the job trains, and the nearest global
    batch that every data-parallel size of the range divides, each only when it works."""
    from megaframe.config.validate import model_parallel_size
    launcher, p, per_node = cfg.launcher, cfg.parallel, cfg.cluster.gpus_per_node
    worlds = world_sizes(launcher, per_node)
    best: list[int] = []
    run: list[int] = []
    for world in worlds:
        run = [] if world in failing else [*run, world]
        if len(run) > len(best):
            best = run
    fixes = []
    if best:
        low, high = -(-best[0] // per_node), best[-1] // per_node
        narrower = dataclasses.replace(launcher, min_nodes=low, nodes=high)
        if low <= high and not set(world_sizes(narrower, per_node)) & failing:
            fixes.append(f"narrow the range to launcher.min_nodes={low} launcher.nodes={high}")
    model_parallel = model_parallel_size(p)
    if p.dp is None and all(world % model_parallel == 0 for world in worlds):
        every = math.lcm(*(p.micro_batch_size * world // model_parallel for world in worlds))
        nearest = every * max(1, round(p.global_batch_size / every))  # the nearest such batch to the user's
        batched = copy.deepcopy(cfg)
        batched.parallel.global_batch_size = nearest
        if nearest != p.global_batch_size and not _failing_worlds(batched, layout_at, fit_problem):
            fixes.append(f"parallel.global_batch_size={nearest} (a multiple of micro_batch_size*dp at every size)")
    if not fixes:
        return "no change of the range or the batch alone trains at every size: change the layout or the model"
    return ", or ".join(fixes)


def rdzv_endpoint(launcher: LauncherConfig, default_host: str) -> str:
    endpoint = launcher.rdzv_endpoint or default_host
    return endpoint if ":" in endpoint else f"{endpoint}:{DEFAULT_RDZV_PORT}"


def torchrun_args(launcher: LauncherConfig, per_node: int, endpoint: str, run_id: str, run_dir: Path) -> list[str]:
    """The agent command and torchrun's flags for one node of the elastic job (the endpoint and id may
    be shell words): node_agent.py runs torchrun's agent, ending with one line and the job's exit code
    where torchrun prints a traceback and exits 1; it reads the job's stop record in run_dir."""
    return ["-m", "megaframe.launch.node_agent", f"--run-dir={run_dir}",
            f"--nnodes={launcher.min_nodes}:{launcher.nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--max-restarts={launcher.max_restarts}", f"--rdzv-conf={rdzv_conf(launcher)}"]


def rdzv_conf(launcher: LauncherConfig) -> str:
    """torchrun's --rdzv-conf: the rendezvous waits (launcher.rdzv_*), written out even at torchrun's
    defaults so the node script shows what a lost node costs: about 3 heartbeats until the
    survivors regroup, then the last call."""
    return f"last_call_timeout={launcher.rdzv_last_call_s},keep_alive_interval={launcher.rdzv_keep_alive_s}"


def node_script(command: str) -> str:
    return ("#!/bin/bash\n# written by megaframe-train launcher.min_nodes: run on every node of the elastic job,\n"
            "# including nodes that join later; each runs torchrun's agent for its ranks\n"
            f"exec env {command}\n")


def stop_file(run_dir: Path, run_id: str) -> Path:
    """Where an elastic torchrun job records a deterministic failure: in the run directory, which
    every node shares, under the job's rendezvous id, so a later job in the same run dir trains."""
    return run_dir / ".job_stop" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', run_id)}.json"


def under_unshared_store() -> bool:
    """A rank of an elastic torchrun job whose rendezvous store is not the workers' (STORE_ENV=1):
    torchrun's agent store, where the job stop lives otherwise, is not there."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def check_range(cfg: TrainConfig, args) -> None:
    """launcher.min_nodes, before launch: the elastic keys and a shared run dir, then every world size
    of the range must resolve a layout and fit; one line naming those that cannot (exit 2)."""
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.validate import ConfigError
    from megaframe.launch.base import fail, pins_run_dir
    from megaframe.config.launcher_rules import check_elastic, check_launcher_cluster
    from megaframe.plan.cli import fit_problem

    if problem := check_launcher_cluster(cfg) or check_elastic(cfg):
        fail(problem)
    if not pins_run_dir(args):
        fail("launcher.min_nodes: every node and attempt of an elastic job writes and resumes from one run "
             "directory; set hydra.run.dir to a path on storage all nodes share")
    try:
        problem = range_problem(cfg, lambda config, world: validate_for_engine(config, world, ask_bf16=False),
                                fit_problem)
    except ConfigError as err:  # the planner's own keys (cluster.*)
        problem = str(err)
    if problem:
        fail(problem)
