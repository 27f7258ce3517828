"""launcher=slurm: the sbatch script it submits (start), and the environment its tasks start in.

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

from megaframe.config.compose import hydra_quoted
from megaframe.config.schema import LauncherConfig, TrainConfig
from megaframe.common.failures import PROG
from megaframe.launch.base import fail, launcher_world_size
from megaframe.launch.elastic import STORE_ENV, rdzv_endpoint, torchrun_args

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


def elastic_sbatch_script(launcher: LauncherConfig, per_node: int, overrides: list[str], run_dir: Path,
                          python: str = sys.executable) -> str:
    """launcher.min_nodes: MIN to MAX nodes (sbatch's --nodes=MIN-MAX), one srun task per node
    running torchrun's elastic agent for that node's GPUs. --no-kill keeps the allocation when a
    node fails, and srun does not end the step when one task does: the other agents go on at the
    smaller size. Nodes of another allocation join by running the same torchrun line with
    launcher.rdzv_endpoint set to this job's first node and
    this job's rendezvous id (docs/elastic.md)."""
    cpus = launcher.cpus_per_task * per_node if launcher.cpus_per_task is not None else None
    lines = sbatch_header(launcher, f"{launcher.min_nodes}-{launcher.nodes}",
                           ["#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={per_node}", "#SBATCH --no-kill"],
                           cpus)
    endpoint = rdzv_endpoint(launcher, "${RDZV_HOST}")  # the shell expands the first node's name
    agent = [python, *torchrun_args(launcher, per_node, "ENDPOINT", "RUN_ID", run_dir), "-m", "megaframe.train",
             *overrides, f"hydra.run.dir={hydra_quoted(str(run_dir))}"]
    # the endpoint and id are the shell's to expand: in double quotes, the other words quoted; torchrun's
    # two arguments are matched whole (a replace over the line rewrote a user's value that held the text)
    shells = {"--rdzv-endpoint=ENDPOINT": f'"--rdzv-endpoint={endpoint}"',
              "--rdzv-id=RUN_ID": '"--rdzv-id=megaframe-${SLURM_JOB_ID}"'}
    line = " ".join(shells.get(a) or shlex.quote(a) for a in agent)
    lines += [f"#SBATCH --output={str(run_dir).replace('%', '%%')}/slurm-%j.out",
              "# written by megaframe-train launcher=slurm launcher.min_nodes: one torchrun elastic agent per node;",
              "# a lost node leaves the others training at the smaller data-parallel size, from the last checkpoint",
              f"export {STORE_ENV}=1  # a rendezvous store per round: without it a joining node hangs (torch 2.13)",
              'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              # srun's own --no-kill: a failed node does not end the step; srun does not inherit
              # --cpus-per-task from the allocation on Slurm 22.05-23.02: one agent runs all of a node's ranks
              "srun --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill"
              + (" --cpus-per-task=${SLURM_CPUS_PER_TASK}" if cpus is not None else "") + " " + line,
              ""]
    return "\n".join(lines)


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


def host_problem(cfg: TrainConfig) -> Optional[str]:
    """No sbatch on this host (unless only the script is written, or this is one of the job's tasks)."""
    if not cfg.launcher.dry_run and launcher_world_size() is None:
        return NO_SBATCH if sbatch_missing() else None
    return None


def waits(job) -> bool:
    return True


def start(job) -> int:
    """Write RUN_DIR/submit.sbatch (atomically) and sbatch it, or print it (dry run); an elastic job
    (launcher.min_nodes) runs one torchrun agent per node of its node range."""
    from megaframe.common.atomic_io import atomic_write_text

    cfg = job.cfg
    run_path = Path(job.run_dir).resolve()
    if problem := run_dir_problem(run_path):  # the dry run too: the script it writes must be the job's
        fail(problem)
    run_path.mkdir(parents=True, exist_ok=True)
    if cfg.launcher.min_nodes is not None:  # elastic: one torchrun agent per node of a node range
        script = elastic_sbatch_script(cfg.launcher, cfg.cluster.gpus_per_node, task_overrides(job.args), run_path,
                                       sys.executable)
    else:
        script = sbatch_script(cfg.launcher, cfg.cluster.gpus_per_node, job.layout.world_size,
                               task_overrides(job.args), run_path)
    path = run_path / "submit.sbatch"
    atomic_write_text(path, script)
    if cfg.launcher.dry_run:
        print(f"{PROG}: launcher.dry_run=true: not submitted; the job script is {path}:\n{script}", flush=True)
        return 0
    try:
        print(f"{PROG}: {submit(path)} ({path}; output in {run_path})", flush=True)
    except SubmitError as err:
        fail(str(err))
    return 0


def job_world_size(cfg: TrainConfig) -> Optional[int]:
    """launcher=slurm with launcher.nodes, or an elastic job (launcher.min_nodes) at its largest:
    the job's ranks, one per GPU of cluster.gpus_per_node (validation refuses these jobs without it)."""
    launcher, per_node = cfg.launcher, cfg.cluster.gpus_per_node
    if launcher.nodes and per_node and (launcher.name == "slurm" or launcher.min_nodes is not None):
        return launcher.nodes * per_node
    return None
