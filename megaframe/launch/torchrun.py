"""A rank an external launcher started: torchrun, srun's tasks (launcher=slurm's job), Ray's workers
(launcher=ray), or launcher=local's own agent. Before it composes anything it is admitted (its
launcher's variables checked, a job stopped earlier not replayed); then it joins its job's run dir
and trains (start)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from megaframe.backends.registry import engine
from megaframe.config.schema import TrainConfig
from megaframe.common.failures import PROG, RunFailure
from megaframe.launch.base import SELF_LAUNCHED, fail, launcher_world_size, pins_run_dir, rank
from megaframe.launch.registry import Job


def host_problem(cfg: TrainConfig) -> Optional[str]:
    return None


def waits(job: Job) -> bool:
    return False


def admit() -> None:
    """Before anything else: a rank dies with its launcher, maps srun's variables, refuses broken
    launcher variables in one line, and ends at once when its job has stopped."""
    from megaframe.launch.guard import die_with_launcher
    from megaframe.launch.slurm import adopt_slurm_env
    from megaframe.common.launch_env import launch_env_problem

    die_with_launcher()  # a rank under torchrun's agent ends when its launcher is killed outright
    adopt_slurm_env()  # an srun task (launcher=slurm's job) joins the process group from SLURM's variables
    if problem := launch_env_problem():  # RANK >= WORLD_SIZE and the like: one line, not C++ stack dumps
        fail(problem)
    stop_if_job_stopped()


def self_launched() -> bool:
    """A rank launcher=local's agent started: the parent composed, validated and planned exactly these
    overrides (the run dir pinned among them), and the task validates Hydra's composition again; a
    second composition here cost every rank about a second of start-up."""
    return bool(os.environ.get(SELF_LAUNCHED)) and launcher_world_size() is not None


def join_job(job: Job) -> None:
    """Right after composition, before the planner: a rank of an elastic torchrun job (elastic.py)
    finds its job's stop record in the shared run dir, keyed by the rendezvous id, and exits at once
    when an earlier attempt wrote it."""
    from megaframe.launch.elastic import stop_file, under_unshared_store
    from megaframe.parallel.elastic import STOP_FILE_ENV, forget_job_finished

    if launcher_world_size() is None or not under_unshared_store():
        return
    if not pins_run_dir(job.args):
        fail("an elastic torchrun job (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) writes and resumes from one run "
             "directory on every node; set hydra.run.dir to a path on storage all nodes share")
    os.environ[STOP_FILE_ENV] = str(stop_file(Path(job.run_dir).resolve(), os.environ["TORCHELASTIC_RUN_ID"]))
    stop_if_job_stopped()
    if rank() == 0:
        forget_job_finished()


def start(job: Job) -> Optional[int]:
    """Train as this rank, in rank 0's run dir; rank 0 alone writes .hydra/."""
    from megaframe.launch.hydra_run import run_hydra

    if job.layout.world_size > 1 and not pins_run_dir(job.args):
        job.args.append(f"hydra.run.dir={shared_run_dir(job.run_dir, job.cfg)}")
    if rank() != 0:
        job.args.append("hydra.output_subdir=null")
    run_hydra(job.args)
    from megaframe.launch.elastic import under_unshared_store
    from megaframe.parallel.elastic import STOP_FILE_ENV, record_job_finished

    if rank() == 0 and os.environ.get(STOP_FILE_ENV) and under_unshared_store():  # an elastic job's run ended
        record_job_finished()
    return None


def shared_run_dir(run_dir: str, cfg: TrainConfig) -> str:
    """Under a launcher every rank must write to rank 0's run dir (timestamps differ per rank)."""
    from megaframe.parallel.rank_zero import decided_by_rank_zero
    from megaframe.training.stop_signal import joining_before_the_run

    try:
        with joining_before_the_run():  # SIGTERM/SIGUSR1/SIGHUP end a waiting rank with 143/138/129
            engine(cfg.backend.name).init_distributed(cfg.train.collective_timeout_s, cfg.train.join_timeout_s)
    except RunFailure as err:  # ranks that never joined (parallel/rendezvous.py): one line, exit 7
        if not getattr(err, "quiet", False):
            print(f"{PROG}: error: {err} [exit {int(err.exit_code)}]", file=sys.stderr, flush=True)
        sys.exit(int(err.exit_code))
    return decided_by_rank_zero(lambda: str(Path(run_dir).resolve()))


def stop_if_job_stopped() -> None:
    """A restart after a deterministic failure (failures.py): exit with its code at once instead of
    replaying it. Under torchrun (elastic too) each node's local rank 0 says why in one line (unless
    another rank exits first and the agent stops it before it prints: then that node says nothing,
    and a job of one node may leave a restart unexplained; its agent's log shows the exit code). Under Ray
    the cause's line is already on the driver's terminal (Ray shows early worker output twice): each
    rank notes the stop in its log, RUN_DIR/logs/rankR.log, instead."""
    if launcher_world_size() is None:
        return
    from megaframe.parallel.elastic import STOP_FILE_ENV, job_stop

    stop = job_stop()
    if stop is None:
        return
    exit_code, message = stop
    line = f"{PROG}: error: not retrying: an earlier attempt of this job failed with: {message} [exit {exit_code}]"
    from megaframe.launch.elastic import under_unshared_store

    if os.environ.get(STOP_FILE_ENV) and not under_unshared_store():  # Ray's worker
        from megaframe.training.failure_report import append_to_log, log_path

        append_to_log(log_path(Path(os.environ[STOP_FILE_ENV]).parent, rank()), line)
    elif os.environ.get("LOCAL_RANK", "0") == "0":  # each node says it in its own output (rank 0's alone did)
        print(line, file=sys.stderr, flush=True)
    sys.exit(exit_code)
