"""`megaframe-train`: argv and launch (composition is config/compose.py, validation config/validate.py).

megaframe-train [OVERRIDE ...]
  1. composes the config and validates it (one-line error, exit code 2, before any process group);
  2. asked for more ranks than it was started with and not under a launcher, it re-runs itself
     under torch.distributed.run on this host;
  3. otherwise hands the same overrides to hydra.main, which creates the run dir and calls train().
Exit codes: docs/failures.md (megaframe/failures.py). A run stopped by SIGINT, SIGTERM, SIGHUP or
SIGUSR1 saves at a step boundary and exits 128 + the signal's number: 130, 143, 129, 138; the ranks
this command launches get the signal passed on, and 300 s to save (_SIGNAL_GRACE_S).
"""
from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from megaframe.backends.registry import engine, validate_for_engine
from megaframe.startup import resume_collector
from megaframe.config.compose import compose, compose_for_run, config_dirs_as_searchpath, override_problem
from megaframe.config.schema import TrainConfig
from megaframe.config.store import register_configs
from megaframe.config.validate import ConfigError, Layout, requested_world_size
from megaframe.config.validate import warnings as validate_warnings
from megaframe.failures import PROG, RunFailure
from megaframe.launch_env import launch_env_problem
from megaframe.launch_guard import LAUNCHER_PID, die_with_launcher
from megaframe import resume_hint
from megaframe.paths import conf_dir
from megaframe.slurm import adopt_slurm_env

_SELF_LAUNCHED = "MEGAFRAME_SELF_LAUNCHED"  # set for the ranks _self_launch starts
_SIGNAL_GRACE_S = 300  # how long ranks stopped by a signal may take to save before torchrun kills them
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # what the agent passes on to the ranks
# Hydra's own flags (help, --cfg job, multirun, ...): Hydra handles them, we do not pre-validate.
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-p", "--package",
                "--resolve", "-m", "--multirun", "-cp", "--config-path", "-cn", "--config-name",
                "-cd", "--config-dir", "--shell-completion", "-sc", "--version", "--experimental-rerun")


def _launcher_world_size() -> Optional[int]:
    """WORLD_SIZE set by torchrun (or another launcher), None when started plainly."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def _rank() -> int:
    """This process's rank under a launcher, 0 otherwise."""
    return int(os.environ.get("RANK", "0"))


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check(overrides: Sequence[str]) -> tuple[TrainConfig, Layout, str]:
    """Compose and validate; exits with code 2 and a one-line message on bad input."""
    cfg, layout, run_dir, _ = _check_composed(overrides)
    return cfg, layout, run_dir


def _check_composed(overrides: Sequence[str]) -> tuple[TrainConfig, Layout, str, DictConfig]:
    """check(), and also Hydra's whole composition, which a one-process run hands to _run_composed."""
    try:
        cfg, run_dir, composed = compose_for_run(overrides)
        if _launcher_world_size() is None and cfg.launcher.min_nodes is not None:
            _check_elastic_range(cfg, overrides)
        world = _launcher_world_size() or _slurm_world_size(cfg) or requested_world_size(cfg)
        layout = validate_for_engine(cfg, world)
    except ConfigError as err:
        _fail(str(err))
    return cfg, layout, run_dir, composed


def _pins_run_dir(args: Sequence[str]) -> bool:
    return any(a.startswith("hydra.run.dir=") for a in args)


def _slurm_world_size(cfg: TrainConfig) -> Optional[int]:
    """launcher=slurm with launcher.nodes, or an elastic job (launcher.min_nodes) at its largest:
    the job's ranks, one per GPU of cluster.gpus_per_node (validation refuses these jobs without it)."""
    launcher, per_node = cfg.launcher, cfg.cluster.gpus_per_node
    if launcher.nodes and per_node and (launcher.name == "slurm" or launcher.min_nodes is not None):
        return launcher.nodes * per_node
    return None


def _check_elastic_range(cfg: TrainConfig, args: Sequence[str]) -> None:
    """launcher.min_nodes, before launch: the elastic keys and a shared run dir, then every world size
    of the range must resolve a layout and fit; one line naming those that cannot (exit 2)."""
    from megaframe.config.validate import check_elastic, check_launcher_cluster
    from megaframe.elastic_launch import range_problem
    from megaframe.plan.cli import fit_problem

    if problem := check_launcher_cluster(cfg) or check_elastic(cfg):
        _fail(problem)
    if not _pins_run_dir(args):
        _fail("launcher.min_nodes: every node and attempt of an elastic job writes and resumes from one run "
              "directory; set hydra.run.dir to a path on storage all nodes share")
    try:
        problem = range_problem(cfg, lambda config, world: validate_for_engine(config, world, ask_bf16=False),
                                fit_problem)
    except ConfigError as err:  # the planner's own keys (cluster.*)
        problem = str(err)
    if problem:
        _fail(problem)


def _launch_elastic(cfg: TrainConfig, layout: Layout, args: list[str], run_dir: str) -> int:
    """launcher.min_nodes, once check() has validated the whole range: start the job: SLURM's script,
    Ray's elastic workers, or (local) the torchrun line every node runs, printed and written to
    RUN_DIR/elastic_node.sh."""
    import uuid

    from megaframe.atomic_io import atomic_write_text
    from megaframe.elastic_launch import NODE_SCRIPT, node_command, node_script

    if cfg.launcher.name == "slurm":
        return _submit_slurm(cfg, layout, args, run_dir)
    run_path = Path(run_dir).resolve()
    if cfg.launcher.name == "ray":
        from megaframe.ray_launcher import run_on_ray
        from megaframe.training.data_setup import dataset_prefix

        args, run_dir = _own_run_dir(args, run_dir)
        dataset_prefix(cfg.data)
        return run_on_ray(cfg, layout.world_size, args, run_path, train_main)
    per_node = cfg.cluster.gpus_per_node
    command = node_command(cfg.launcher, per_node, args, run_path, f"megaframe-{uuid.uuid4().hex[:12]}")
    script = run_path / NODE_SCRIPT
    run_path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(script, node_script(command))
    script.chmod(0o755)
    print(f"{PROG}: elastic job of {cfg.launcher.min_nodes} to {cfg.launcher.nodes} nodes, {per_node} "
          f"rank{'s' if per_node > 1 else ''} per node: run this on every node, also on nodes that join later "
          f"(it is {script}):\n{command}", flush=True)
    return 0


def _join_elastic_stop_record(args: list[str], run_dir: str) -> None:
    """A rank of an elastic torchrun job (elastic_launch.py): its job's stop record is a file in the
    shared run directory, keyed by the rendezvous id; exit at once when an earlier attempt wrote it."""
    from megaframe.elastic_launch import stop_file, under_unshared_store
    from megaframe.parallel.elastic import STOP_FILE_ENV

    if not under_unshared_store():
        return
    if not _pins_run_dir(args):
        _fail("an elastic torchrun job (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) writes and resumes from one run "
              "directory on every node; set hydra.run.dir to a path on storage all nodes share")
    os.environ[STOP_FILE_ENV] = str(stop_file(Path(run_dir).resolve(), os.environ["TORCHELASTIC_RUN_ID"]))
    _stop_if_job_stopped()


def _submit_slurm(cfg: TrainConfig, layout: Layout, args: list[str], run_dir: str) -> int:
    """launcher=slurm: write RUN_DIR/submit.sbatch (atomically) and sbatch it, or print it (dry run)."""
    from megaframe.slurm import SubmitError, run_dir_problem, sbatch_script, submit, task_overrides
    from megaframe.atomic_io import atomic_write_text

    run_path = Path(run_dir).resolve()
    if problem := run_dir_problem(run_path):  # the dry run too: the script it writes must be the job's
        _fail(problem)
    run_path.mkdir(parents=True, exist_ok=True)
    if cfg.launcher.min_nodes is not None:  # elastic: one torchrun agent per node of a node range
        from megaframe.elastic_launch import elastic_sbatch_script

        script = elastic_sbatch_script(cfg.launcher, cfg.cluster.gpus_per_node, task_overrides(args), run_path,
                                       sys.executable)
    else:
        script = sbatch_script(cfg.launcher, cfg.cluster.gpus_per_node, layout.world_size, task_overrides(args),
                               run_path)
    path = run_path / "submit.sbatch"
    atomic_write_text(path, script)
    if cfg.launcher.dry_run:
        print(f"{PROG}: launcher.dry_run=true: not submitted; the job script is {path}:\n{script}", flush=True)
        return 0
    try:
        print(f"{PROG}: {submit(path)} ({path}; output in {run_path})", flush=True)
    except SubmitError as err:
        _fail(str(err))
    return 0


def _dataset_problem(cfg: TrainConfig) -> Optional[str]:
    """Open data.path's files before launch (headers, sizes, metadata; the token scan runs after
    launch, shared by the ranks) and split them as the ranks will (memory maps and views: too few
    tokens for one sample on either side, sources built with different tokenizers): what is wrong,
    in one line, or None."""
    from megaframe.data import DataError
    from megaframe.data.blend import parse_blend
    from megaframe.training.data_setup import build_data

    try:
        prefixes = [prefix for prefix in (cfg.data.path, cfg.data.valid_path) if prefix is not None]
        for blend, key in ((cfg.data.blend, "data.blend"), (cfg.data.valid_blend, "data.valid_blend")):
            prefixes += parse_blend(list(blend), key)[1] if blend else []
        if prefixes:  # opened once, as the ranks open them; the built-in corpus is built after launch
            build_data(cfg.data, cfg.model.seq_length)
    except DataError as err:
        return str(err)
    return None


def _check_dataset(cfg: TrainConfig) -> None:
    """A broken dataset is one line and exit code 2, before launch."""
    if problem := _dataset_problem(cfg):
        _fail(problem)


def _check_resume(cfg: TrainConfig, run_dir: str) -> None:
    """A run dir that would start over on top of an earlier run's history (its checkpoints not
    mounted, a file in their place: checkpoint/resume_checks.py) is one line and exit code 2, before
    launch; every rank of a launched job exits, rank 0 says why."""
    from megaframe.checkpoint.resume_checks import prelaunch_problem

    if problem := prelaunch_problem(Path(run_dir), cfg.train.resume):
        if _rank() == 0:
            print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)


def _check_sweep_point(point: list[str]) -> None:
    """One point of a -m sweep, as megaframe-train alone would check it before launching its ranks
    (compose, validate, the planner's fit, the launcher's package, the dataset's files)."""
    from megaframe.plan.estimate import estimate_config
    from megaframe.plan.profiles import profile_hint
    from megaframe.plan.report import verdict

    cfg, _ = compose(point)
    layout = validate_for_engine(cfg, _slurm_world_size(cfg) or requested_world_size(cfg), ask_bf16=False)
    if cfg.plan.check and not cfg.parallel.auto and not (est := estimate_config(cfg, layout)).fits:
        raise ConfigError(f"the planner says this will not fit: {verdict(est)}{profile_hint(cfg, layout) or ''} "
                          f"(plan.check=false skips this check)")
    if problem := _launcher_problem(cfg) or _dataset_problem(cfg):
        raise ConfigError(problem)


def _check_sweep(args: list[str]) -> None:
    """`-m` (and no other Hydra flag): every point is checked before the first launches."""
    from megaframe.sweep import check_sweep

    flags = {a for a in args if a.split("=", 1)[0] in _HYDRA_FLAGS}
    if not flags or not flags <= {"-m", "--multirun"}:
        return
    try:
        check_sweep([a for a in args if a not in flags], _check_sweep_point)
    except ConfigError as err:
        _fail(str(err))


def _launcher_problem(cfg: TrainConfig) -> Optional[str]:
    """What this host lacks for cfg.launcher (Ray's package, SLURM's sbatch), in one line, or None."""
    if cfg.launcher.name == "ray":
        from megaframe.ray_launcher import MISSING, ray_missing, unreachable_cluster

        return MISSING if ray_missing() else unreachable_cluster(cfg.launcher.ray_address)
    if cfg.launcher.name == "slurm" and not cfg.launcher.dry_run and _launcher_world_size() is None:
        from megaframe.slurm import NO_SBATCH, sbatch_missing

        return NO_SBATCH if sbatch_missing() else None
    return None


def _check_launcher(cfg: TrainConfig) -> None:
    """An optional launcher's package or command must be there, and an online W&B run its key: one
    line before anything starts."""
    from megaframe.tracking.wandb_run import online_key_problem

    if problem := _launcher_problem(cfg) or online_key_problem(cfg.logging.wandb.mode):
        _fail(problem)


def _check_system(cfg: TrainConfig, layout: Layout) -> None:
    """What the machine must provide for this layout (DeepSpeed's AutoEP for ZeRO-3 experts) and
    offload setting (libaio, a compiler, NVMe space), before any rank starts: one line and exit
    code 2 when something is missing."""
    if cfg.zero.stage == 3 and cfg.parallel.ep > 1:
        if problem := engine(cfg.backend.name).expert_parallel_problem(cfg.zero.stage, cfg.parallel.ep):
            _fail(problem)
    if cfg.offload.optimizer == "none" and cfg.offload.param == "none":
        return
    from megaframe.plan.estimate import estimate_config

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    try:
        swap_bytes = estimate_config(cfg, layout).host_bytes * ranks_here
    except ConfigError:  # the planner cannot size this model: check the pieces, not the space
        swap_bytes = 0.0
    if problem := engine(cfg.backend.name).system_problem(cfg.offload, swap_bytes):
        _fail(problem)


def _self_launch(overrides: list[str], world: int, run_dir: str) -> int:
    """Run this command as `world` ranks under torchrun's elastic agent, in this process, so that a
    failed rank ends the command with that rank's exit code (failures.py) rather than torchrun's 1,
    and the agent's own failure report (a traceback) stays off the terminal: the failing rank has
    printed its one line, and its traceback is in RUN_DIR/logs."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from megaframe.failures import exit_code_of_job

    os.environ[_SELF_LAUNCHED] = "1"
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the agent runs in this process: the ranks' parent
    # one BLAS thread per rank unless the user chose: ranks would otherwise oversubscribe the cores
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    # torch's elastic modules each set their own logger's level (WARNING): quiet every one, so a
    # Ctrl-C or SIGTERM the ranks handle (training/stop_signal.py) prints no agent warning
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    print(f"{PROG}: launching {world} ranks on this host", flush=True)
    # Ctrl-C or SIGTERM reaches the agent, which passes it to the ranks (training/stop_signal.py): they
    # stop at one step boundary and may save; a rank is SIGKILLed only after this grace
    # SIGUSR1 too (SLURM's --signal=USR1@90 before the time limit): the agent passes it on and the ranks
    # stop and save as for SIGTERM (torch's agent, left to its default list, dies of it unsaved)
    grace = ["--shutdown-timeout", str(_SIGNAL_GRACE_S), f"--signals-to-handle={_agent_signals()}"]
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={world}", *grace, "-m", "megaframe.train", *overrides]))
    except ChildFailedError as err:
        _name_a_killed_rank(err)
        return exit_code_of_job([failure.exitcode for failure in err.failures.values()])
    except SignalException as err:  # the ranks have stopped (or were killed after the grace)
        return 128 + int(err.sigval)
    return 0


def _agent_signals() -> str:
    """_AGENT_SIGNALS less those ignored now (SIGHUP under `nohup`): the agent would catch and pass on
    what the user asked to ignore, and the ranks inherit SIG_IGN and keep ignoring it (stop_signal.py)."""
    from megaframe.training.stop_signal import not_ignored

    return ",".join(signal.Signals(s).name for s in not_ignored(signal.Signals[name] for name in _AGENT_SIGNALS))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def _name_a_killed_rank(err) -> None:
    """A rank that a signal killed first (the OOM killer's SIGKILL) prints nothing itself: say which
    rank it was and by what. The others then end by the agent's SIGTERM or their peers' errors.

    torch stamps a failure without an error file in whole seconds and breaks ties by rank: the
    rank the kernel killed and a peer that failed on the broken connection a moment later often
    share the first second, and then the peer came first. So a SIGKILLed rank of that second is the
    cause (nothing else kills without a word); failing that, the first failure, if a signal."""
    first_second = min(failure.timestamp for failure in err.failures.values())
    killed = [rank for rank, failure in sorted(err.failures.items())
              if failure.timestamp == first_second and failure.exitcode == -signal.SIGKILL]
    if killed:
        rank, exitcode = killed[0], -signal.SIGKILL
    else:
        rank, first = err.get_first_failure()
        if first.exitcode is None or first.exitcode >= 0:
            return  # a rank that exited with a code has said why itself
        exitcode = first.exitcode
    name = _signal_name(-exitcode)
    hint = " (the kernel's OOM killer sends it when memory runs out: see `dmesg`)" if name == "SIGKILL" else ""
    print(f"{PROG}: error (rank {rank}): killed by {name}{hint} [exit 1]", file=sys.stderr, flush=True)


def _own_run_dir(args: list[str], run_dir: str) -> tuple[list[str], str]:
    """Lock the run dir (run_lock.py) for this process and the ranks it starts, pinning it in the
    overrides so Hydra cannot pick another timestamp; refuse in one line when another run holds it."""
    from megaframe.run_lock import lock_for_children
    from megaframe.slurm import hydra_quoted

    run_dir = str(Path(run_dir).resolve())
    if not _pins_run_dir(args):
        args = [*args, f"hydra.run.dir={hydra_quoted(run_dir)}"]
    try:
        problem = lock_for_children(Path(run_dir))
    except OSError as err:  # a file where the run dir should be, a read-only parent
        problem = f"hydra.run.dir={run_dir}: cannot create the run directory ({err.strerror}); choose another"
    if problem:
        _fail(problem)
    return args, run_dir


def _shared_run_dir(run_dir: str, cfg: TrainConfig) -> str:
    """Under a launcher every rank must write to rank 0's run dir (timestamps differ per rank)."""
    import torch.distributed as dist

    from megaframe.training.stop_signal import joining_before_the_run

    try:
        with joining_before_the_run():  # SIGTERM/SIGUSR1/SIGHUP end a waiting rank with 143/138/129
            engine(cfg.backend.name).init_distributed(cfg.train.collective_timeout_s, cfg.train.join_timeout_s)
    except RunFailure as err:  # ranks that never joined (parallel/rendezvous.py): one line, exit 7
        if not getattr(err, "quiet", False):
            print(f"{PROG}: error: {err} [exit {int(err.exit_code)}]", file=sys.stderr, flush=True)
        sys.exit(int(err.exit_code))
    holder = [str(Path(run_dir).resolve())]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _stop_if_job_stopped() -> None:
    """A restart after a deterministic failure (failures.py): exit with its code at once instead of
    replaying it. Under torchrun (elastic too) rank 0 says why in one line. Under Ray the cause's line is already
    on the driver's terminal (Ray shows early worker output twice): each rank notes the stop in its
    log, RUN_DIR/logs/rankR.log, instead."""
    if _launcher_world_size() is None:
        return
    from megaframe.parallel.elastic import STOP_FILE_ENV, job_stop

    stop = job_stop()
    if stop is None:
        return
    exit_code, message = stop
    line = f"{PROG}: error: not retrying: an earlier attempt of this job failed with: {message} [exit {exit_code}]"
    from megaframe.elastic_launch import under_unshared_store

    if os.environ.get(STOP_FILE_ENV) and not under_unshared_store():  # Ray's worker
        from megaframe.training.failure_report import append_to_log, log_path

        append_to_log(log_path(Path(os.environ[STOP_FILE_ENV]).parent, _rank()), line)
    elif _rank() == 0:
        print(line, file=sys.stderr, flush=True)
    sys.exit(exit_code)


def _task(dict_cfg) -> None:
    """What hydra.main runs: type the config, validate again (cheap), train."""
    from hydra.core.hydra_config import HydraConfig

    from megaframe.training.trainer import train
    from megaframe.atomic_io import atomic_write_text

    try:
        cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
        layout = validate_for_engine(cfg, _launcher_world_size() or requested_world_size(cfg))
    except ConfigError as err:
        _fail(str(err))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if _rank() == 0:
        # the composition typed by the schema writes what OmegaConf.structured(cfg) would, without
        # building the schema's node tree again (about 0.05 s of every start); with the ZeRO stage the
        # engine's default chose (zero=engine_default composes it as null)
        dict_cfg.zero.stage = cfg.zero.stage
        atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(dict_cfg, resolve=True))
    # DeepSpeed's ZeRO calls torch collectives torch 2.13 has renamed: a warning per rank, not the user's business
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    exit_code = train(cfg, layout, run_dir, _rank())  # after launch: one line and the cause's exit code
    if exit_code:
        sys.exit(exit_code)


def _run_hydra(args: list[str]) -> None:
    """Hydra's flags (-m, --cfg, --help, ...) through hydra.main; a plain run through _run_once."""
    import hydra

    if not any(a.split("=", 1)[0] in _HYDRA_FLAGS for a in args):
        register_configs(args)
        _run_once(args)
        return
    register_configs()  # --help, --cfg, -m: every recipe, as Hydra may list or sweep them
    sys.argv = [sys.argv[0], *args]
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_task)()


def _run_once(overrides: list[str]) -> None:
    """What hydra.main does for a single run (the run dir, .hydra/, job logging, HydraConfig, then
    _task), less its first step: hydra.main composes the whole config once only to read hydra.mode,
    then again for the run. That probe was about a second of every rank's start-up; the mode here is
    known. Hydra's internal API: hydra-core 1.3's, unchanged since 1.1."""
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra

    app = _cli_hydra()
    try:
        run_and_report(lambda: app.run(config_name="config", task_function=_task,
                                       overrides=[*overrides, "hydra.mode=RUN"]))
    finally:
        GlobalHydra.instance().clear()


def _cli_hydra():
    """Hydra's app for megaframe-train's runs. Task name "cli", as hydra.main derived it from this
    file: RUN_DIR/cli.log, hydra.job.name."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path, run_and_report

    search_path = create_config_search_path(str(conf_dir()))
    return run_and_report(lambda: Hydra.create_main_hydra2(task_name="cli", config_search_path=search_path))


def _run_composed(composed: DictConfig, run_dir: str, pinned: list[str]) -> None:
    """What Hydra's run does after composing (Hydra.run in hydra-core 1.3: logging, callbacks,
    run_job with the run dir, .hydra/, HydraConfig), given the composition check() made; `pinned`
    holds the hydra.run.dir override that _own_run_dir added, recorded as Hydra would record it."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    GlobalHydra.instance().clear()  # compose_for_run registered what the composition needs
    app = _cli_hydra()
    with open_dict(composed):
        composed.hydra.mode = RunMode.RUN
        composed.hydra.run.dir = run_dir
        composed.hydra.overrides.hydra.extend([*pinned, "hydra.mode=RUN"])
    def run() -> None:  # Hydra.run after its compose_config, inside run_and_report as hydra.main has it
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
        callbacks = Callbacks(composed)
        callbacks.on_run_start(config=composed, config_name="config")
        ret = run_job(hydra_context=HydraContext(config_loader=app.config_loader, callbacks=callbacks),
                      task_function=_task, config=composed, job_dir_key="hydra.run.dir", job_subdir_key=None,
                      configure_logging=True)
        callbacks.on_run_end(config=composed, config_name="config", job_return=ret)
        _ = ret.return_value  # re-raises what the task raised, for run_and_report to report

    try:
        run_and_report(run)
    finally:
        GlobalHydra.instance().clear()


def train_main(argv: Optional[Sequence[str]] = None) -> None:
    """`megaframe-train`: validate, launch as many ranks as the layout needs, train."""
    try:
        _train_main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the trainer took over SIGINT (training/stop_signal.py)
        print(f"{PROG}: interrupted (SIGINT) before the first step: nothing to save", file=sys.stderr, flush=True)
        sys.exit(130)


def _train_main(argv: Optional[Sequence[str]]) -> None:
    try:
        args = config_dirs_as_searchpath(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        _fail(str(err))
    die_with_launcher()  # a rank under torchrun's agent ends when its launcher is killed outright
    adopt_slurm_env()  # an srun task (launcher=slurm's job) joins the process group from SLURM's variables
    if problem := launch_env_problem():  # RANK >= WORLD_SIZE and the like: one line, not C++ stack dumps
        _fail(problem)
    _stop_if_job_stopped()
    if any(a.split("=", 1)[0] in _HYDRA_FLAGS for a in args):
        resume_collector()  # a sweep waits on its points' runs, and --cfg/--help only print
        if problem := override_problem(args):  # --cfg job, --help: Hydra's own error would not say where it went
            _fail(problem)
        _check_sweep(args)
        _run_hydra(args)
        return
    if os.environ.get(_SELF_LAUNCHED) and _launcher_world_size() is not None:
        # a rank this command started: the parent composed, validated and planned exactly these
        # overrides (the run dir pinned among them), and _task validates Hydra's composition again;
        # a second composition here cost every rank about a second of start-up
        _run_hydra(args if _rank() == 0 else [*args, "hydra.output_subdir=null"])
        return
    from megaframe.plan.cli import preflight

    if _launcher_world_size() is None:  # the user's own command: the closing line's resume hint repeats it
        resume_hint.remember_command(sys.argv[1:] if argv is None else argv)
    try:
        args = resume_hint.latest_run(args)  # train.resume=latest-run: hydra.run.dir names that run
    except ConfigError as err:
        _fail(str(err))
    cfg, layout, run_dir, composed = _check_composed(args)
    launched = _launcher_world_size() is not None
    if launched:
        _join_elastic_stop_record(args, run_dir)
    elastic_launch = not launched and cfg.launcher.min_nodes is not None
    # an elastic job's planner check covers every world size of its range (_launch_elastic), and
    # parallel=auto plans each attempt's world in its ranks
    planned = args if elastic_launch else preflight(cfg, layout, args, PROG)  # exits 2 when it cannot fit
    if planned is not args:  # parallel=auto chose a layout: the ranks get it as overrides
        args = planned
        cfg, layout, run_dir, composed = _check_composed(args)
    composed_args = list(args)
    _check_launcher(cfg)
    _check_dataset(cfg)
    _check_resume(cfg, run_dir)
    _check_system(cfg, layout)
    if _rank() == 0:
        for warning in validate_warnings(cfg, layout, engine(cfg.backend.name).config_warnings):
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    if not (launched or (not elastic_launch and cfg.launcher.name == "local" and layout.world_size == 1)):
        resume_collector()  # start-up ends here: this process goes on to wait for the ranks or jobs it launches
    if elastic_launch:
        sys.exit(_launch_elastic(cfg, layout, args, run_dir))
    if not launched and cfg.launcher.name == "slurm":
        sys.exit(_submit_slurm(cfg, layout, args, run_dir))
    if not launched:  # this process owns the job on this host: one line and exit 2 if another does
        args, run_dir = _own_run_dir(args, run_dir)
    if not launched and cfg.launcher.name == "ray":
        from megaframe.ray_launcher import run_on_ray

        from megaframe.training.data_setup import dataset_prefix

        dataset_prefix(cfg.data)  # build the demo corpus once, not in every worker
        sys.exit(run_on_ray(cfg, layout.world_size, args, Path(run_dir).resolve(), train_main))
    if not launched and layout.world_size > 1:
        from megaframe.training.data_setup import dataset_prefix

        dataset_prefix(cfg.data)  # build the demo corpus once, not in every rank
        sys.exit(_self_launch(args, layout.world_size, run_dir))
    if launched and layout.world_size > 1 and not _pins_run_dir(args):
        args.append(f"hydra.run.dir={_shared_run_dir(run_dir, cfg)}")
    if not launched and args[:len(composed_args)] == composed_args and len(args) - len(composed_args) <= 1:
        # one process, and the overrides are those composed above (plus the run dir _own_run_dir
        # pinned): run that composition rather than compose again (about 0.2 s of every start)
        _run_composed(composed, run_dir, args[len(composed_args):])
        return
    if _rank() != 0:
        args.append("hydra.output_subdir=null")  # rank 0 alone writes .hydra/
    _run_hydra(args)
