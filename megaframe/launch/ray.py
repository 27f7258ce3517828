"""launcher=ray: the trainer in Ray Train's TorchTrainer workers, one per rank.

Ray Train starts the workers, sets up their process group (gloo, or NCCL with GPUs) and their
RANK/WORLD_SIZE/LOCAL_RANK; each worker then runs megaframe-train's own path as a launched rank,
into one run directory (rank 0's, passed explicitly). FailureConfig(max_failures) restarts the
whole worker group after a failure, and train.resume=auto makes each new attempt continue from
the run's last checkpoint. Ray is an optional extra: `pip install "megaframe[ray]"`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from megaframe.config.schema import TrainConfig
from megaframe.common.failures import PROG
from megaframe.common.startup_signals import default_in_place_of_startup

STOP_FILE = ".job_stop.json"  # parallel/elastic.py: an earlier attempt's deterministic failure
STOP_REQUEST_FILE = ".stop_request"  # a signal the driver got, for rank 0 to take as its own (stop_signal.py)
STOPPED_FILE = ".stopped_on_request"  # written by a worker that stopped at a step boundary as the driver asked
MISSING = 'launcher=ray needs Ray Train, which is not installed: pip install "megaframe[ray]"'


def ray_missing() -> bool:
    return importlib.util.find_spec("ray") is None


def unreachable_cluster(address: Optional[str]) -> Optional[str]:
    """One line when nothing answers at launcher.ray_address (HOST:PORT or ray://HOST:PORT): Ray's
    own connection attempt would wait minutes there before failing. None (nothing to check) for no
    address or `auto`, which Ray resolves on this host."""
    if not address or address in ("auto", "local"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return f"launcher.ray_address={address} is not HOST:PORT, ray://HOST:PORT or auto"
    try:
        with socket.create_connection((host, int(port)), timeout=10):
            return None
    except OSError as err:
        return (f"launcher.ray_address={address}: nothing answers there ({err.strerror or err}); start the cluster "
                f"(ray start --head) or correct the address")


def run_on_ray(cfg: TrainConfig, world_size: int, overrides: list[str], run_dir: Path,
               entry: Callable[[list[str]], None]) -> int:
    """Train on `world_size` Ray workers, each calling entry(argv) (megaframe-train's main, passed in
    by the CLI); 0 when the run finished, else the failed attempt's exit code (1 when Ray reports an
    error without one)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from megaframe.launch.slurm import task_overrides

    launcher = cfg.launcher
    if not ray.is_initialized():
        # the workers see the driver's megaframe, W&B and thread settings, also on a remote cluster
        passed = {k: v for k, v in os.environ.items() if k.startswith(("MEGAFRAME_", "WANDB_")) or k == "OMP_NUM_THREADS"}
        # Ray's own INFO/WARNING lines stay in its session logs; without the dashboard (ray[train]
        # has none) Ray Train's placement-group watcher would warn every second that the state
        # API is unavailable. The ranks' own output (progress, one-line errors) is unaffected.
        # Ray's core logs a line a second to stderr while it cannot reach a cluster: into a file
        init_log = run_dir / "logs" / "ray_init.log"
        try:
            with _give_up_after(launcher.connect_timeout_s, launcher.ray_address, init_log), _stderr_into(init_log):
                ray.init(address=launcher.ray_address, include_dashboard=False, runtime_env={"env_vars": passed},
                         logging_level=logging.ERROR, logging_config=ray.LoggingConfig(log_level="ERROR"))
        except (ConnectionError, RuntimeError, ValueError) as err:
            print(f"{PROG}: error: launcher.ray_address={launcher.ray_address}: cannot join that Ray cluster "
                  f"({_first_line(err)}); check the address, and where the cluster uses token authentication "
                  f"set RAY_AUTH_MODE=token (and its token) here too [exit 2; Ray's messages in {init_log}]",
                  file=sys.stderr, flush=True)
            return 2
    from megaframe.launch.elastic import is_elastic, world_sizes

    # elastic (launcher.min_nodes): Ray Train picks any worker count in the range that the cluster has
    # room for at each (re)start, and checks every resize_interval_s whether a healthy group can grow
    elastic = is_elastic(launcher)
    sizes = world_sizes(launcher, cfg.cluster.gpus_per_node) if elastic else [world_size]
    workers = (sizes[0], sizes[-1]) if elastic else world_size
    resize = {"elastic_resize_monitor_interval_s": launcher.resize_interval_s} if elastic else {}
    resources = {"CPU": launcher.cpus_per_worker, **({"GPU": launcher.gpus_per_worker} if launcher.gpus_per_worker else {})}
    trainer = _ray_trainer_class(TorchTrainer)(
        _worker, train_loop_config={"overrides": task_overrides(overrides), "run_dir": str(run_dir), "entry": entry},
        # Ray creates the process group: its timeout must be megaframe's, or a hung rank holds the
        # others for Ray's default 30 minutes instead of ending the job with exit code 7
        torch_config=TorchConfig(backend="nccl" if launcher.gpus_per_worker else "gloo",
                                 timeout_s=math.ceil(cfg.train.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=workers,
                                     use_gpu=bool(launcher.gpus_per_worker), resources_per_worker=resources, **resize),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir / "ray"),
                             failure_config=FailureConfig(max_failures=launcher.max_failures),
                             **_quiet_train_logs()))
    # a stop recorded or asked for by an earlier launch in this run dir is not this job's
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    (run_dir / STOP_REQUEST_FILE).unlink(missing_ok=True)
    (run_dir / STOPPED_FILE).unlink(missing_ok=True)
    # Ray Train v1 runs fit() through Tune, whose own SIGINT handler would end the trials unsaved
    os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")
    asked: list[int] = []
    try:
        with _signals_to_the_workers(run_dir / STOP_REQUEST_FILE, asked, cfg.train.save_on_signal):
            try:
                error = trainer.fit().error  # Ray before 2.5x returned the error
            except Exception as err:  # Ray Train 2.5x raises it (WorkerGroupError, ControllerError)
                error = err
    except KeyboardInterrupt:  # a second signal, or no request could be written: Ray ends the workers now
        signum = asked[-1] if asked else signal.SIGINT
        print(f"{PROG}: {signal.Signals(signum).name}: stopping the Ray workers now, without saving",
              file=sys.stderr, flush=True)
        return 128 + signum
    if error is None:
        return finished_code(asked, (run_dir / STOPPED_FILE).exists())
    code = _exit_code(error)
    if code == 1:  # no rank said why (killed, out of memory, Ray itself): say it here, in one line
        print(f"{PROG}: error: Ray Train failed: {_first_line(error)} [exit 1; Ray's own logs: "
              f"/tmp/ray/session_latest/logs on the head node]", file=sys.stderr, flush=True)
    return code


def finished_code(asked: list[int], stopped: bool) -> int:
    """The driver's exit code when the workers ended without an error: 128 + the first signal taken
    when they stopped on it, else 0. A signal that came after the last step (in the run's last save,
    or as the workers ended) stops nothing: the run is complete, and a nonzero code would mark it
    failed (a scheduler could requeue it), as torchrun's ranks already exit 0 then."""
    return 128 + asked[0] if asked and stopped else 0


@contextlib.contextmanager
def _signals_to_the_workers(request: Path, asked: list[int], saves: bool) -> Iterator[None]:
    """SIGINT, SIGTERM, SIGHUP or SIGUSR1 at the driver (Ctrl-C, `kill`, `ray job stop`): its number
    is written to `request` in the run dir, which rank 0 takes as its own signal (StopSignal.
    watch_requests), so every rank stops after the same step and saves, as a self-launched run does;
    the workers then end as asked (_worker) and the driver exits 128 + the signal's number. Before,
    Ray killed the workers unsaved and the driver exited 1 saying nothing. A second signal, or a
    request that cannot be written (a full disk), raises KeyboardInterrupt: Ray ends the workers at
    once. `asked`: the signals taken, in order; saves: train.save_on_signal, for the line."""
    from megaframe.common.atomic_io import atomic_write_text
    from megaframe.training.stop_signal import SAME_REQUEST_S, SIGNALS, not_ignored

    first_at = [0.0]

    def handle(signum: int, _frame) -> None:
        if asked:
            if signum == asked[0] and time.monotonic() - first_at[0] < SAME_REQUEST_S:
                return  # the same request passed on by a process group's other members
            asked.append(signum)
            raise KeyboardInterrupt
        asked.append(signum)
        first_at[0] = time.monotonic()
        try:
            atomic_write_text(request, f"{int(signum)}\n")
        except OSError as err:
            print(f"{PROG}: cannot ask the Ray workers to stop: writing {request} failed ({err})", file=sys.stderr,
                  flush=True)
            raise KeyboardInterrupt from err
        print(f"{PROG}: {signal.Signals(signum).name}: the Ray workers stop after their step"
              f"{', saving first' if saves else ''} (again to stop them now, without saving)", file=sys.stderr,
              flush=True)

    main = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, handle) for signum in (not_ignored(SIGNALS) if main else ())}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, default_in_place_of_startup(handler))
        request.unlink(missing_ok=True)


def _ray_trainer_class(trainer_class: type) -> type:
    """TorchTrainer as megaframe runs it, two Ray Train 2.5x defaults off (a Ray without them, such as
    Ray Train v1, never calls the overrides):
    - Ray Data's DatasetManager actor, which it starts at every worker-group start even without
      `datasets=` (a fresh Python process, ~2 CPU-s); megaframe's ranks read their own data;
    - its SIGINT handler, which fit() installs over the driver's own (_signals_to_the_workers) and
      which aborts the run, the workers killed unsaved."""
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:
        DatasetsCallback = None

    class Trainer(trainer_class):
        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            if DatasetsCallback is None or self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

        def _register_sigint_handler(self, controller) -> None:
            pass  # Ctrl-C is the driver's: the ranks stop at a step boundary and save
    return Trainer


@contextlib.contextmanager
def _give_up_after(timeout_s: float, address: Optional[str], log: Path) -> Iterator[None]:
    """End the process with one line if the block (ray.init, which cannot be interrupted while it
    waits for a cluster that does not answer as Ray) runs longer than timeout_s. Entered before
    _stderr_into, it keeps the terminal's stderr for that line."""
    terminal = os.dup(2)

    def give_up() -> None:
        os.write(terminal, (f"{PROG}: error: launcher.ray_address={address}: no Ray cluster joined within "
                            f"launcher.connect_timeout_s={timeout_s:g} s; check the address and the cluster "
                            f"[exit 2; Ray's messages in {log}]\n").encode())
        os._exit(2)
    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        os.close(terminal)


@contextlib.contextmanager
def _stderr_into(path: Path) -> Iterator[None]:
    """This process's file descriptor 2 (Python's and Ray's C++ core's stderr) appended to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "a", encoding="utf-8") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _quiet_train_logs() -> dict:
    """RunConfig's logging_config where this Ray has one (Ray Train's v2 API): its console logs would
    repeat each failed worker's traceback, while the rank has printed its one line (its traceback is
    in RUN_DIR/logs) and Ray's session logs keep everything."""
    try:
        from ray.train import LoggingConfig
    except ImportError:
        return {}
    return {"logging_config": LoggingConfig(log_level="CRITICAL")}


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _exit_code(error: BaseException) -> int:
    """The job's exit code from Ray's error: each failed worker's SystemExit code (Ray Train keeps
    them in worker_failures; older Ray chains them as causes), the documented cause winning over
    the ranks that only followed it (failures.exit_code_of_job); 1 when none carried a code."""
    from megaframe.common.failures import exit_code_of_job

    codes = []
    for failure in [*getattr(error, "worker_failures", {}).values(), error]:
        seen = failure
        while seen is not None:
            if isinstance(seen, SystemExit) and isinstance(seen.code, int):
                codes.append(seen.code)
                break
            seen = seen.__cause__ or seen.__context__
    return exit_code_of_job(codes) if any(codes) else 1


def _worker(config: dict) -> None:
    """One rank: megaframe-train's launched-rank path, in Ray's process group. A deterministic
    failure (divergence, bad data, a bad checkpoint) is recorded in the run dir, so the attempts
    FailureConfig starts after it exit at once with its code instead of replaying it."""
    from megaframe.parallel.elastic import STOP_FILE_ENV
    from megaframe.config.compose import hydra_quoted
    from megaframe.training.stop_signal import REQUEST_FILE_ENV, SIGNALS

    os.environ[STOP_FILE_ENV] = str(Path(config["run_dir"]) / STOP_FILE)
    os.environ[REQUEST_FILE_ENV] = str(request := Path(config["run_dir"]) / STOP_REQUEST_FILE)
    try:
        config["entry"]([*config["overrides"], f"hydra.run.dir={hydra_quoted(config['run_dir'])}"])
    except SystemExit as ended:
        # stopped at a step boundary as the driver asked: a success to Ray, which would restart a
        # failed worker group (FailureConfig) into training on; the driver returns the signal's code
        if isinstance(ended.code, int) and ended.code - 128 in SIGNALS and request.exists():
            from megaframe.common.atomic_io import atomic_write_text

            with contextlib.suppress(OSError):  # the driver then says 0: the steps done are saved either way
                atomic_write_text(Path(config["run_dir"]) / STOPPED_FILE, f"{ended.code}\n")
            return
        raise


def host_problem(cfg: TrainConfig) -> Optional[str]:
    """Ray's package missing, or nothing answering at launcher.ray_address."""
    return MISSING if ray_missing() else unreachable_cluster(cfg.launcher.ray_address)


def waits(job) -> bool:
    return True


def start(job) -> int:
    """Lock and pin the run dir, build the demo corpus once (not in every worker), train on Ray's
    workers; an elastic job (launcher.min_nodes) asks Ray for a worker range (run_on_ray)."""
    from megaframe.launch.local import own_run_dir
    from megaframe.launch.main import train_main
    from megaframe.training.data_setup import dataset_prefix

    job.args, job.run_dir = own_run_dir(job.args, job.run_dir)
    dataset_prefix(job.cfg.data)
    return run_on_ray(job.cfg, job.layout.world_size, job.args, Path(job.run_dir).resolve(), train_main)
