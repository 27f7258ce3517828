"""`megaframe-train`: argv, the checks before launch, and the launcher that starts the job.

megaframe-train [OVERRIDE ...]
  1. composes the config and validates it (one-line error, exit code 2, before any process group:
     launch/checks.py);
  2. hands the checked job to its launcher (launch/registry.py): on this host in one process or
     under torch.distributed.run (local), as one rank an external launcher started (torchrun),
     submitted to SLURM, or on Ray's workers; elastic (launcher.min_nodes) is a mode of each;
  3. a run in this process goes through Hydra's run (launch/hydra_run.py), which creates the run dir
     and calls train().
Exit codes: docs/failures.md (megaframe/common/failures.py). A run stopped by SIGINT, SIGTERM, SIGHUP or
SIGUSR1 saves at a step boundary and exits 128 + the signal's number: 130, 143, 129, 138; the ranks
this command launches get the signal passed on, and 300 s to save (local.SIGNAL_GRACE_S).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from megaframe import resume_hint
from megaframe.config.compose import compose, config_dirs_as_searchpath, override_problem
from megaframe.config.validate import ConfigError
from megaframe.common.ctrl_c import shutdown_not_stopped
from megaframe.common.failures import PROG
from megaframe.launch import torchrun
from megaframe.launch.base import fail, hydra_flag_names, hydra_flags, launcher_world_size, rank
from megaframe.launch.checks import check_before_launch, check_composed
from megaframe.launch.hydra_run import run_hydra
from megaframe.launch.registry import Job, launcher_for
from megaframe.common.process_exit import exit_past_daemon_threads
from megaframe.common.startup import resume_collector


def train_main(argv: Optional[Sequence[str]] = None) -> None:
    """`megaframe-train`: validate, launch as many ranks as the layout needs, train."""
    try:
        _train_main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the trainer took over SIGINT (training/stop_signal.py)
        print(f"{PROG}: interrupted (SIGINT) before the first step: nothing to save", file=sys.stderr, flush=True)
        sys.exit(130)
    finally:  # the run is over and reported (its process group destroyed): a late Ctrl-C is no traceback
        shutdown_not_stopped()


# Hydra's flags that print the composed config, each with the value it takes as the next argument
_PRINTING_FLAGS = {"-c": True, "--cfg": True, "--resolve": False, "-p": True, "--package": True}


# Hydra's modes, of which a command takes one (Hydra raised a ValueError's traceback for two)
_MODES = ({"-m", "--multirun"}, {"-c", "--cfg"}, {"-i", "--info"}, {"-sc", "--shell-completion"})


def modes_problem(args: Sequence[str]) -> Optional[str]:
    flags = hydra_flag_names(args)
    if primary := sorted(flags & {"-cn", "--config-name", "-cp", "--config-path"}):
        # Hydra's multi-line "Cannot find primary config", exit 1: megaframe composes conf/config.yaml
        return (f"{primary[0]}: megaframe composes its own primary config (conf/config.yaml); put your options in "
                f"a group folder and pass it with --config-dir DIR GROUP=NAME (docs/configuration.md)")
    given = [sorted(mode & flags)[0] for mode in _MODES if mode & flags]
    if len(given) > 1:
        return (f"{' and '.join(given)}: Hydra runs one of -m, --cfg, --info and --shell-completion at a time; "
                f"drop all but one")
    return None


def printed_config_problem(args: Sequence[str]) -> Optional[str]:
    """`--cfg job OVERRIDES` (the documented preview of a command) composes as a run would: a mistyped
    key or group is one line, where Hydra printed its own multi-line error with exit 1. Left to Hydra
    with -m (another primary config, --config-name or --config-path, is refused by modes_problem)."""
    flags = hydra_flag_names(args)
    if not flags or not flags <= set(_PRINTING_FLAGS):
        return None
    overrides, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in _PRINTING_FLAGS:
            skip = _PRINTING_FLAGS[arg]
        elif arg.split("=", 1)[0] not in _PRINTING_FLAGS:
            overrides.append(arg)
    try:
        compose(overrides)
    except ConfigError as err:
        return str(err)
    return None


def _train_main(argv: Optional[Sequence[str]]) -> None:
    typed = sys.argv[1:] if argv is None else argv
    try:
        args = config_dirs_as_searchpath(typed)
    except ConfigError as err:
        fail(str(err))
    torchrun.admit()  # a rank started by a launcher: its variables, its launcher's death, a stopped job
    if hydra_flags(args):
        resume_collector()  # a sweep waits on its points' runs, and --cfg/--help only print
        if problem := override_problem(args):  # --cfg job, --help: Hydra's own error would not say where it went
            fail(problem)
        if problem := modes_problem(args) or printed_config_problem(args):
            fail(problem)
        from megaframe.launch.sweep import check_args

        check_args(args)
        run_hydra(args)
        return
    if torchrun.self_launched():  # checked by the parent: no second composition
        run_hydra(args if rank() == 0 else [*args, "hydra.output_subdir=null"])
        return
    if launcher_world_size() is None:  # the user's own command: the closing line's resume hint repeats it
        resume_hint.remember_command(typed)
    try:
        args = resume_hint.latest_run(args)  # train.resume=latest-run: hydra.run.dir names that run
    except ConfigError as err:
        fail(str(err))
    job = Job(*check_composed(args), args=args)
    torchrun.join_job(job)  # a rank of an elastic torchrun job: its job's stop record
    if not job.elastic:  # an elastic job's planner check covers every world of its range (elastic.check_range)
        from megaframe.plan.cli import preflight

        planned = preflight(job.cfg, job.layout, args, PROG)  # exits 2 when it cannot fit
        if planned is not args:  # parallel=auto chose a layout: the ranks get it as overrides
            job = Job(*check_composed(planned), args=planned)
    job.composed_args = list(job.args)
    check_before_launch(job.cfg, job.layout, job.run_dir)
    start = launcher_for(job.cfg)
    if start.waits(job):
        resume_collector()  # start-up ends here: this process goes on to wait for the ranks or jobs it launches
    if (exit_code := start.start(job)) is not None:
        # the job has ended; a waiting launcher ran torch's agent here, whose daemon threads can abort
        # the interpreter's finalization (common/process_exit.py)
        exit_past_daemon_threads(exit_code)
