"""launcher=local: the job on this host. One rank runs in this process; more run under torchrun's
elastic agent, in this process (start); an elastic job (launcher.min_nodes) is the torchrun line
every node runs, printed and written to RUN_DIR/elastic_node.sh."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

from megaframe.config.compose import hydra_quoted
from megaframe.config.schema import LauncherConfig, TrainConfig
from megaframe.common.failures import PROG
from megaframe.common.startup_signals import default_in_place_of_startup
from megaframe.launch.base import SELF_LAUNCHED, fail, pins_run_dir
from megaframe.launch.elastic import STORE_ENV, rdzv_endpoint, torchrun_args
from megaframe.launch.guard import LAUNCHER_PID
from megaframe.launch.registry import Job
from megaframe.launch.slurm import task_overrides

SIGNAL_GRACE_S = 300  # how long ranks stopped by a signal may take to save before torchrun kills them
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # what the agent passes on to the ranks


def host_problem(cfg: TrainConfig) -> Optional[str]:
    return None


def waits(job: Job) -> bool:
    """A one-process run trains here; otherwise this process waits for its ranks (or prints a line)."""
    return job.elastic or job.layout.world_size > 1


def start(job: Job) -> Optional[int]:
    from megaframe.launch import hydra_run

    if job.elastic:
        return start_elastic(job)
    job.args, job.run_dir = own_run_dir(job.args, job.run_dir)
    if job.layout.world_size > 1:
        from megaframe.training.data_setup import dataset_prefix

        dataset_prefix(job.cfg.data)  # build the demo corpus once, not in every rank
        return self_launch(job.args, job.layout.world_size, job.run_dir)
    args, composed_args = job.args, job.composed_args
    if args[:len(composed_args)] == composed_args and len(args) - len(composed_args) <= 1:
        # one process, and the overrides are those composed before launch (plus the run dir
        # own_run_dir pinned): run that composition rather than compose again (about 0.2 s of every start)
        hydra_run.run_composed(job.composed, job.run_dir, args[len(composed_args):])
    else:
        hydra_run.run_hydra(args)
    return None


def start_elastic(job: Job) -> int:
    """launcher.min_nodes, once the whole range is checked: the torchrun line every node runs,
    printed and written to RUN_DIR/elastic_node.sh."""
    import uuid

    from megaframe.common.atomic_io import atomic_write_text
    from megaframe.launch.elastic import NODE_SCRIPT, node_script

    cfg, run_path = job.cfg, Path(job.run_dir).resolve()
    per_node = cfg.cluster.gpus_per_node
    command = node_command(cfg.launcher, per_node, job.args, run_path, f"megaframe-{uuid.uuid4().hex[:12]}")
    script = run_path / NODE_SCRIPT
    run_path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(script, node_script(command))
    script.chmod(0o755)
    print(f"{PROG}: elastic job of {cfg.launcher.min_nodes} to {cfg.launcher.nodes} nodes, {per_node} "
          f"rank{'s' if per_node > 1 else ''} per node: run this on every node, also on nodes that join later "
          f"(it is {script}):\n{command}", flush=True)
    return 0


def node_command(launcher: LauncherConfig, per_node: int, overrides: list[str], run_dir: Path, run_id: str,
                 python: str = sys.executable) -> str:
    """The shell line every node of a launcher=local elastic job runs (joining nodes too)."""
    endpoint = rdzv_endpoint(launcher, socket.getfqdn())
    argv = [python, *torchrun_args(launcher, per_node, endpoint, run_id, run_dir), "-m", "megaframe.train",
            *task_overrides(overrides), f"hydra.run.dir={hydra_quoted(str(run_dir))}"]
    return f"{STORE_ENV}=1 " + " ".join(shlex.quote(a) for a in argv)


def own_run_dir(args: list[str], run_dir: str) -> tuple[list[str], str]:
    """Lock the run dir (run_lock.py) for this process and the ranks it starts, pinning it in the
    overrides so Hydra cannot pick another timestamp; refuse in one line when another run holds it."""
    from megaframe.common.run_lock import lock_for_children

    run_dir = str(Path(run_dir).resolve())
    if not pins_run_dir(args):
        args = [*args, f"hydra.run.dir={hydra_quoted(run_dir)}"]
    try:
        problem = lock_for_children(Path(run_dir))
    except OSError as err:  # a file where the run dir should be, a read-only parent
        problem = f"hydra.run.dir={run_dir}: cannot create the run directory ({err.strerror}); choose another"
    if problem:
        fail(problem)
    return args, run_dir


def self_launch(overrides: list[str], world: int, run_dir: str) -> int:
    """Run this command as `world` ranks under torchrun's elastic agent, in this process (run_agent), so
    that a failed rank ends the command with that rank's exit code and no traceback; the agent's log
    lines are quieted too: a Ctrl-C the ranks handle is theirs to report."""
    import logging

    from torch.distributed.run import parse_args  # its elastic modules' loggers exist from here on

    os.environ[SELF_LAUNCHED] = "1"
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the agent runs in this process: the ranks' parent
    # one BLAS thread per rank unless the user chose: ranks would otherwise oversubscribe the cores
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    # torch's elastic modules each set their own logger's level (WARNING) when imported: quiet every
    # one, so a Ctrl-C or SIGTERM the ranks handle (training/stop_signal.py) prints no agent warning
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    print(f"{PROG}: launching {world} ranks on this host", flush=True)
    # Ctrl-C or SIGTERM reaches the agent, which passes it to the ranks (training/stop_signal.py): they
    # stop at one step boundary and may save; a rank is SIGKILLed only after this grace
    # SIGUSR1 too (SLURM's --signal=USR1@90 before the time limit): the agent passes it on and the ranks
    # stop and save as for SIGTERM (torch's agent, left to its default list, dies of it unsaved)
    grace = ["--shutdown-timeout", str(SIGNAL_GRACE_S), f"--signals-to-handle={agent_signals()}"]
    return run_agent(parse_args(["--standalone", f"--nproc-per-node={world}", *grace, "-m", "megaframe.train",
                                 *overrides]), run_dir)


def run_agent(agent_args, run_dir: Optional[str] = None) -> int:
    """torch's elastic agent in this process, given torchrun's parsed command line; returns the job's
    exit code (failures.py: the documented cause of the first failing rank) where torchrun would exit 1
    after its failure report, a traceback. The failing rank has printed its one line, and its
    traceback is in RUN_DIR/logs. Used by self_launch and by every elastic node (node_agent.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from megaframe.common.failures import exit_code_of_job

    previous = _signals_end_the_agent(agent_args.signals_to_handle, SignalException)
    try:
        run(agent_args)
    except ChildFailedError as err:
        if name_a_killed_rank(err) == 0 and run_dir is not None:
            print(closing_line_for_rank_0(Path(run_dir)), flush=True)
        return exit_code_of_job([failure.exitcode for failure in err.failures.values()])
    except SignalException as err:  # the ranks have stopped (or were killed after the grace), or never started
        return 128 + int(err.sigval)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, default_in_place_of_startup(handler))
    return 0


def _signals_end_the_agent(names: str, signal_exception: type) -> dict:
    """The signals the agent passes on end it as torch's own handler does once the ranks run (a
    SignalException: the ranks stopped, the rendezvous left open for the other nodes), from now on:
    torch installs it only when it starts the ranks, and before that (an elastic node waits minutes to
    join) Ctrl-C was a KeyboardInterrupt, a traceback, and torch's launcher closed the rendezvous for every
    node. Returns the handlers it replaced."""
    def stop(signum: int, _frame) -> None:
        raise signal_exception(f"Process {os.getpid()} got signal: {signal.Signals(signum).name}",
                               sigval=signal.Signals(signum))

    previous = {}
    for name in names.split(","):
        signum = getattr(signal, name.strip(), None)
        if isinstance(signum, signal.Signals):
            previous[signum] = signal.signal(signum, stop)
    return previous


def agent_signals() -> str:
    """AGENT_SIGNALS less those ignored now (SIGHUP under `nohup`): the agent would catch and pass on
    what the user asked to ignore, and the ranks inherit SIG_IGN and keep ignoring it (stop_signal.py)."""
    from megaframe.training.stop_signal import not_ignored

    return ",".join(signal.Signals(s).name for s in not_ignored(signal.Signals[name] for name in AGENT_SIGNALS))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def closing_line_for_rank_0(run_dir: Path) -> str:
    """The run's closing line, which rank 0 prints, when a signal killed rank 0 (the OOM killer's
    SIGKILL): the step of metrics.jsonl's last records, the last checkpoint and how to resume, as the
    launcher sees them (rank 0's losses and times died with it)."""
    from megaframe.checkpoint.resume_checks import last_logged_step
    from megaframe.checkpoint.store import find_latest
    from megaframe.checkpoint.universal import CheckpointError
    from megaframe.resume_hint import resume_command

    step = last_logged_step(run_dir / "metrics.jsonl")
    try:
        last = find_latest(run_dir / "checkpoints")
    except (CheckpointError, OSError):  # an edited `latest`, storage gone: the resume says so
        last = None
    parts = [f"megaframe: failed at step {step if step and step > 0 else 0} (rank 0 killed: the step of "
             f"metrics.jsonl's last record)", f"last checkpoint {last or 'none'}"]
    if last is not None:
        parts.append(f"resume: {resume_command(run_dir)}")
    return " | ".join(parts)


def name_a_killed_rank(err) -> Optional[int]:
    """A rank that a signal killed first (the OOM killer's SIGKILL) prints nothing itself: say which
    rank it was and by what. The others then end by the agent's SIGTERM or their peers' errors.

    torch stamps a failure without an error file in whole seconds and breaks ties by rank: the
    rank the kernel killed and a peer that failed on the broken connection a moment later often
    share the first second, and then the peer came first. So a SIGKILLed rank of that second is the
    cause (nothing else kills without a word); failing that, the first failure, if a signal.
    Returns the rank named, or None."""
    first_second = min(failure.timestamp for failure in err.failures.values())
    killed = [rank for rank, failure in sorted(err.failures.items())
              if failure.timestamp == first_second and failure.exitcode == -signal.SIGKILL]
    if killed:
        rank, exitcode = killed[0], -signal.SIGKILL
    else:
        rank, first = err.get_first_failure()
        if first.exitcode is None or first.exitcode >= 0:
            return None  # a rank that exited with a code has said why itself
        exitcode = first.exitcode
    name = _signal_name(-exitcode)
    hint = " (the kernel's OOM killer sends it when memory runs out: see `dmesg`)" if name == "SIGKILL" else ""
    print(f"{PROG}: error (rank {rank}): killed by {name}{hint} [exit 1]", file=sys.stderr, flush=True)
    return rank
