"""SLURM: the sbatch script `launcher=slurm` submits, and the environment its tasks start in.

Why a generated sbatch script with `srun`, one task per GPU, rather than torchrun inside SLURM
or Hydra's submitit launcher: srun already starts, places and (with --kill-on-bad-exit) stops one
process per GPU, so nothing sits between SLURM and the ranks; the script is a plain file the user
can read, keep and resubmit; submitit's maintainers advise against nesting torchrun in its jobs.

Each task finds SLURM's variables and no torchrun ones; adopt_slurm_env() maps them to what
torch.distributed's env:// rendezvous reads: RANK=SLURM_PROCID, WORLD_SIZE=SLURM_NTASKS,
LOCAL_RANK=SLURM_LOCALID, MASTER_ADDR = the first host of SLURM_JOB_NODELIST, MASTER_PORT from the
job id (unless set).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, MutableMapping, Optional

from megaframe.config.schema import LauncherConfig

# the variables of an srun task (SLURM_STEP_ID: srun sets it; the batch script itself runs as task 0
# of the allocation without it, and must not join a process group alone)
TASK_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_STEP_ID")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[003-010,012],cpu1' -> 'gpu003'."""
    first, depth = "", 0
    for char in nodelist:
        if char == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(char, 0)
        first += char
    match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _tasks_per_node(env: Mapping[str, str]) -> Optional[str]:
    if env.get("SLURM_NTASKS_PER_NODE"):
        return env["SLURM_NTASKS_PER_NODE"]
    tasks = env.get("SLURM_TASKS_PER_NODE")  # e.g. '8(x2)' or '8,4'
    return re.match(r"\d+", tasks).group(0) if tasks else None


def adopt_slurm_env(env: MutableMapping[str, str] = os.environ) -> bool:
    """Inside an srun task without torchrun's variables, set them from SLURM's; True when it did."""
    if "RANK" in env or "WORLD_SIZE" in env or not all(env.get(v) for v in TASK_VARIABLES):
        return False
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = env["SLURM_PROCID"], env["SLURM_NTASKS"], env["SLURM_LOCALID"]
    if local_world := _tasks_per_node(env):
        env["LOCAL_WORLD_SIZE"] = local_world
    env.setdefault("MASTER_ADDR", first_host(env["SLURM_JOB_NODELIST"]))
    # every task of the job derives the same port; a fixed one would collide between jobs on a node
    env.setdefault("MASTER_PORT", str(10000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    return True


def sbatch_script(launcher: LauncherConfig, gpus_per_node: int, world_size: int, overrides: list[str],
                  run_dir: Path, python: str = sys.executable) -> str:
    """The job: one srun task per rank of the layout, one GPU each, on `nodes` nodes (by default as
    few as hold world_size ranks at gpus_per_node a node, the cluster's; a layout smaller than a node
    takes only the GPUs it uses, so `parallel.dp=2` asks for 2 tasks and 2 GPUs, not a whole node's
    worth)."""
    per_node = min(gpus_per_node, world_size)
    nodes = launcher.nodes or -(-world_size // per_node)
    lines = sbatch_header(launcher, str(nodes), [f"#SBATCH --ntasks={world_size}",
                                                  f"#SBATCH --ntasks-per-node={per_node}",
                                                  f"#SBATCH --gpus-per-node={per_node}"], launcher.cpus_per_task)
    lines += [f"#SBATCH --output={str(run_dir).replace('%', '%%')}/slurm-%j.out",  # %% is a literal % to sbatch
              "# written by megaframe-train launcher=slurm: one srun task per GPU; each maps SLURM_PROCID,",
              "# SLURM_NTASKS, SLURM_LOCALID and the first host of SLURM_JOB_NODELIST to its process group",
              "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
              "srun --kill-on-bad-exit=1 " + " ".join(shlex.quote(a) for a in
                                                       [python, "-m", "megaframe.train", *overrides,
                                                        f"hydra.run.dir={hydra_quoted(str(run_dir))}"]),
              ""]
    return "\n".join(lines)


def sbatch_header(launcher: LauncherConfig, nodes: str, task_lines: list[str], cpus_per_task: Optional[int]) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={launcher.job_name}", f"#SBATCH --nodes={nodes}", *task_lines]
    for flag, value in (("cpus-per-task", cpus_per_task), ("partition", launcher.partition),
                        ("account", launcher.account), ("time", launcher.time)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines + [f"#SBATCH {extra}" for extra in launcher.sbatch_extra]


def hydra_quoted(value: str) -> str:
    """`value` as a quoted string of Hydra's override grammar, so ':', '=', ',' or brackets in a
    path stay part of it. Hydra reads a backslash as an escape only in a run of them before a quote
    (or the closing one): those runs are doubled, then each quote escaped."""
    if re.fullmatch(r"[\w./+~@-]+", value):
        return value  # nothing Hydra would read as grammar: the job script stays plain
    doubled = re.sub(r"(\\+)(?='|$)", lambda run: run.group(1) * 2, value)
    return "'" + doubled.replace("'", "\\'") + "'"


def run_dir_problem(run_dir: Path) -> Optional[str]:
    """Why launcher=slurm cannot use this run directory, or None: sbatch's --output takes no
    whitespace, and non-ASCII or control characters break it on many sites' configurations."""
    text = str(run_dir)
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 or ord(c) > 126 for c in text):
        return (f"hydra.run.dir={text!r}: launcher=slurm needs a run directory of printable ASCII without spaces "
                f"(sbatch's --output takes it); choose another, e.g. hydra.run.dir=runs/my_job")
    return None


def task_overrides(overrides: list[str]) -> list[str]:
    """The command line of the job's tasks: the user's, without the launcher's own keys (a task
    does not submit again) and without a run dir (the script sets the shared one)."""
    return [o for o in overrides
            if not re.match(r"^(launcher(\.|=)|hydra\.run\.dir=)", o)]


class SubmitError(RuntimeError):
    """sbatch is missing or refused the job: one line for the user."""


NO_SBATCH = ("launcher=slurm: no sbatch command on this host; run on a SLURM login node, "
             "or set launcher.dry_run=true to write the script only")


def sbatch_missing() -> bool:
    return shutil.which("sbatch") is None


def submit(script_path: Path) -> str:
    """sbatch the script; returns sbatch's answer ('Submitted batch job N')."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SubmitError(NO_SBATCH)
    done = subprocess.run([sbatch, str(script_path)], capture_output=True, text=True)
    if done.returncode:
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SubmitError(f"launcher=slurm: sbatch refused {script_path}: {said}")
    return done.stdout.strip()
