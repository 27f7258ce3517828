"""`python -m megaframe.launch.node_agent --run-dir=DIR TORCHRUN_FLAGS -m megaframe.train OVERRIDES`: what
every node of an elastic job runs (launch/elastic.py torchrun_args: RUN_DIR/elastic_node.sh and the
SLURM script).

It is torchrun's elastic agent with torchrun's own flags, run in this process as megaframe-train's
self-launch runs it (local.py run_agent), because torchrun ends a failed job with a Python traceback
(its failure report) on every node and exit code 1 whatever the cause. Here each node ends with one
line and a documented code (docs/elastic.md):
- the ranks failed: the job's exit code (3 for a divergence; docs/failures.md), after the failing
  rank's own line;
- the rendezvous closed under this node (another node ended the job, and the c10d host shut the
  rendezvous): the cause the job recorded in RUN_DIR/.job_stop (launch/elastic.py stop_file), else 1;
- the job ended while this node waited as a spare (the rendezvous already had launcher.nodes nodes):
  the job's recorded cause, else 0;
- the job's run had ended normally (rank 0 recorded it in RUN_DIR/.job_stop) when the rendezvous
  closed under this node (it came late, or was restarted) or this spare's wait ended: 0. Not when the
  host is unreachable: a job requeued under the same id must not lose a node to the last run's record;
- this node could not join (no host at the endpoint, too few nodes in time): 7, as a rank that does
  not join;
- a signal (SLURM's scancel or preemption, Ctrl-C): 128 + its number, the ranks stopped and saved as
  self-launch's do (the same signals passed on, the same grace), the rendezvous left open for the others;
- torchrun's flags it cannot use (--nnodes=3:2): 2, before it joins;
- anything else: 1, with the traceback in RUN_DIR/logs.
The agent's log lines (a failed attempt, a restart, a node that left) stay: on an elastic job they say
what happened.
"""
from __future__ import annotations

import socket
import sys
import traceback
from pathlib import Path

from megaframe.common.failures import PROG, ExitCode
from megaframe.launch.elastic import NODE_SCRIPT, stop_file

RUN_DIR_FLAG = "--run-dir="
# torchrun's flags (and the PET_ variables that set their defaults) for what the agent does with a
# signal: the node line leaves them out, and each node uses self-launch's (local.py) unless it sets them
OWN_SIGNAL_FLAGS = {"--signals-to-handle": "PET_SIGNALS_TO_HANDLE", "--shutdown-timeout": "PET_SHUTDOWN_TIMEOUT"}


def main(argv: list[str]) -> int:
    if not argv or not argv[0].startswith(RUN_DIR_FLAG):
        print(f"{PROG}: error: usage: python -m megaframe.launch.node_agent {RUN_DIR_FLAG}DIR TORCHRUN_FLAGS "
              "-m megaframe.train OVERRIDES (megaframe-train launcher.min_nodes writes this line) [exit 2]",
              file=sys.stderr)
        return ExitCode.REFUSED
    run_dir = Path(argv[0][len(RUN_DIR_FLAG):]).resolve()  # as the ranks resolve it (torchrun.py)
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousError,
                                                          RendezvousTimeoutError)
    from torch.distributed.run import parse_args

    from megaframe.launch.local import run_agent

    args = parse_args([*_signal_flags(), *argv[1:]])  # argparse keeps a flag's last value: the line's own
    if problem := _flags_problem(args):
        return _say(f"error: torchrun's flags on this node's line: {problem}; correct the line (RUN_DIR/{NODE_SCRIPT} "
                    "or the SLURM script's srun)", ExitCode.REFUSED)
    try:
        return run_agent(args)
    except RendezvousClosedError:
        return _job_ended(run_dir, args.rdzv_id)
    except AttributeError as err:
        if err.name == "is_failed" and err.obj is None:  # a spare node's end (_job_ended)
            return _job_ended(run_dir, args.rdzv_id, spare=True)
        return _internal_error(err, run_dir)
    except RendezvousTimeoutError:
        min_nodes = str(args.nnodes).split(":")[0]
        return _say(f"error: fewer than {min_nodes} nodes joined the elastic job's rendezvous at "
                    f"{args.rdzv_endpoint} within torchrun's join timeout ({_join_timeout_s(args.rdzv_conf)} s); "
                    f"start the job's node line (RUN_DIR/{NODE_SCRIPT}, or the SLURM script's srun) on at least "
                    f"launcher.min_nodes={min_nodes} nodes", ExitCode.RANK_HUNG)
    except RendezvousError as err:  # the host is not there (yet), has gone, or its store broke
        return _say(f"error: this node could not reach the elastic job's rendezvous at {args.rdzv_endpoint} "
                    f"({type(err).__name__}: {_one_line(err)}); start the node that hosts it "
                    "(launcher.rdzv_endpoint) first, and check that this node reaches it (on a job that was "
                    "training: that node has ended or is unreachable)", ExitCode.RANK_HUNG)
    except Exception as err:  # noqa: BLE001  a bug of ours or torch's: one line, the traceback in a file
        return _internal_error(err, run_dir)


def _signal_flags() -> list[str]:
    """Self-launch's signal handling (local.py) as torchrun flags, for those the node sets nowhere: the
    signals the ranks stop and save on (SIGUSR1 too: SLURM's --signal=USR1@90, of which torchrun's
    default list would let the agent die, its ranks left running), less those ignored on this node
    (SIGHUP under nohup), and the grace they have to save in (torchrun's default 30 s)."""
    import os

    from megaframe.launch.local import SIGNAL_GRACE_S, agent_signals

    chosen = {"--signals-to-handle": agent_signals(), "--shutdown-timeout": str(SIGNAL_GRACE_S)}
    return [f"{flag}={value}" for flag, value in chosen.items() if OWN_SIGNAL_FLAGS[flag] not in os.environ]


def _flags_problem(args) -> str | None:
    """What torchrun's agent would refuse of its flags once started (--nnodes=3:2, a port that is not a
    number), read now, before this node joins, as its own error rather than a traceback."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import config_from_args

    try:
        config_from_args(args)
        parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)  # what the c10d handler reads
    except (AssertionError, RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {_one_line(err).rstrip('.')}"
    return None


def _job_ended(run_dir: Path, rdzv_id: str, spare: bool = False) -> int:
    """The job ended on another node: the rendezvous closed under this one, or this one waited as a
    spare (it came when the rendezvous had launcher.nodes nodes; when the job ends torch's agent returns
    no result for it, RendezvousGracefulExitError swallowed, and torch's launcher fails on that:
    AttributeError: 'NoneType' object has no attribute 'is_failed', torch 2.13). The job's recorded
    deterministic failure, else 1 for a node that was in the job and 0 for a spare, which did nothing."""
    from megaframe.parallel.elastic import read_stop_file

    if (ended := _ended_normally(run_dir, rdzv_id, spare)) is not None:
        return ended
    stop = read_stop_file(str(stop_file(run_dir, rdzv_id)))
    if stop is not None:
        code, message = stop
        waited = " while this one waited as a spare" if spare else ""
        return _say(f"error: the elastic job ended on another node{waited}: {message}", code)
    if spare:
        return _say("the elastic job ended while this node waited as a spare (the job had launcher.nodes nodes); "
                    "its other nodes' output says how", ExitCode.OK)
    return _say("the elastic job's rendezvous is closed: the job ended on another node, with no "
                "deterministic failure recorded; that node's output and RUN_DIR/logs say why", ExitCode.INTERNAL)


def _ended_normally(run_dir: Path, rdzv_id: str, spare: bool) -> int | None:
    """0, with one line, when rank 0 recorded that the job's run ended normally; else None."""
    from megaframe.parallel.elastic import read_stop_file

    stop = read_stop_file(str(stop_file(run_dir, rdzv_id)), finished=True)
    if stop is None or stop[0] != ExitCode.OK:
        return None
    when = "while this one waited as a spare" if spare else "before this node joined"
    return _say(f"nothing to do: {stop[1]} {when}", ExitCode.OK)


def _internal_error(err: BaseException, run_dir: Path) -> int:
    return _say(f"error: the elastic node agent failed: {type(err).__name__}: {_one_line(err)}",
                ExitCode.INTERNAL, _write_traceback(run_dir))


def _say(line: str, code: int, traceback_file: Path | None = None) -> int:
    where = f"; traceback in {traceback_file}" if traceback_file else ""
    print(f"{PROG}: {line} [exit {int(code)}{where}]", file=sys.stderr, flush=True)
    return int(code)


def _join_timeout_s(rdzv_conf: str) -> str:
    """torchrun's --rdzv-conf join_timeout (its default 600 s; launch/elastic.py rdzv_conf leaves it)."""
    conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item)
    return conf.get("join_timeout", "600")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:500]


def _write_traceback(run_dir: Path) -> Path | None:
    """The traceback appended to this node's agent log, beside the ranks' (failure_report.py's
    append_to_log: dated, every attempt kept, never through a planted link)."""
    from megaframe.training.failure_report import append_to_log

    path = run_dir / "logs" / f"node-agent-{socket.gethostname()}.log"
    try:
        append_to_log(path, traceback.format_exc())
    except OSError:
        return None
    return path


if __name__ == "__main__":
    from megaframe.common.process_exit import exit_past_daemon_threads

    exit_past_daemon_threads(main(sys.argv[1:]))  # the agent's daemon threads: common/process_exit.py
