"""Hydra's run for megaframe-train, in one file: what hydra.main does, less what costs every start.

- run_hydra: Hydra's flags (-m, --cfg, --help, ...) through hydra.main; a plain run through run_once.
- run_once: hydra.main's single run less its first step, a whole composition only to read hydra.mode.
- run_composed: Hydra's run after composing, given the composition the pre-launch check made.
- task: what each of them runs: type the config, validate again (cheap), write config.yaml, train.
Hydra's internal API: hydra-core 1.3's, unchanged since 1.1. The job is named "cli" (RUN_DIR/cli.log,
hydra.job.name), as when megaframe/cli.py held this code.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from megaframe.backends.registry import validate_for_engine
from megaframe.config.schema import TrainConfig
from megaframe.config.store import register_configs
from megaframe.config.validate import ConfigError, requested_world_size
from megaframe.launch.base import HYDRA_FLAGS, fail, launcher_world_size, rank
from megaframe.common.paths import conf_dir

TASK_NAME = "cli"  # Hydra's job name: RUN_DIR/cli.log, hydra.job.name


def task(dict_cfg) -> None:
    """What Hydra runs: type the config, validate again (cheap), train."""
    from hydra.core.hydra_config import HydraConfig

    from megaframe.common.atomic_io import atomic_write_text
    from megaframe.training.trainer import train

    try:
        cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
        layout = validate_for_engine(cfg, launcher_world_size() or requested_world_size(cfg))
    except ConfigError as err:
        fail(str(err))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if rank() == 0 and _owns(run_dir):
        # the composition typed by the schema writes what OmegaConf.structured(cfg) would, without
        # building the schema's node tree again (about 0.05 s of every start); with the ZeRO stage the
        # engine's default chose (zero=engine_default composes it as null)
        dict_cfg.zero.stage = cfg.zero.stage
        atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(dict_cfg, resolve=True))
    # DeepSpeed's ZeRO calls torch collectives torch 2.13 has renamed: a warning per rank, not the user's business
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    exit_code = train(cfg, layout, run_dir, rank())  # after launch: one line and the cause's exit code
    if exit_code:
        sys.exit(exit_code)


def _owns(run_dir: Path) -> bool:
    """Whether this rank 0 holds the run dir (its launcher took it, or it takes it now), before it
    writes config.yaml there: under torchrun or srun a second job's rank 0 used to replace the
    running job's config.yaml (which megaframe-eval reads back) before the trainer's start-up check
    refused it. Refused here, it writes nothing; that check then ends every rank with the reason."""
    from megaframe.common import run_lock

    return run_lock.held_by_parent(run_dir) or run_lock.acquire(run_dir) is None


def _main_task(dict_cfg) -> None:
    task(dict_cfg)


# hydra.main names the job after the task function's module (its last dotted part): TASK_NAME
_main_task.__module__ = f"megaframe.{TASK_NAME}"


def run_hydra(args: list[str]) -> None:
    """Hydra's flags (-m, --cfg, --help, ...) through hydra.main; a plain run through run_once."""
    import hydra

    if not any(a.split("=", 1)[0] in HYDRA_FLAGS for a in args):
        register_configs(args)
        run_once(args)
        return
    register_configs()  # --help, --cfg, -m: every recipe, as Hydra may list or sweep them
    sys.argv = [sys.argv[0], *args]
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_main_task)()


def run_once(overrides: list[str]) -> None:
    """What hydra.main does for a single run (the run dir, .hydra/, job logging, HydraConfig, then
    task), less its first step: hydra.main composes the whole config once only to read hydra.mode,
    then again for the run. That probe was about a second of every rank's start-up; the mode here is
    known."""
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra

    app = _hydra_app()
    try:
        run_and_report(lambda: app.run(config_name="config", task_function=task,
                                       overrides=[*overrides, "hydra.mode=RUN"]))
    finally:
        GlobalHydra.instance().clear()


def _hydra_app():
    """Hydra's app for megaframe-train's runs, its task named TASK_NAME."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path, run_and_report

    search_path = create_config_search_path(str(conf_dir()))
    return run_and_report(lambda: Hydra.create_main_hydra2(task_name=TASK_NAME, config_search_path=search_path))


def run_composed(composed: DictConfig, run_dir: str, pinned: list[str]) -> None:
    """What Hydra's run does after composing (Hydra.run in hydra-core 1.3: logging, callbacks,
    run_job with the run dir, .hydra/, HydraConfig), given the composition the check made; `pinned`
    holds the hydra.run.dir override that local.own_run_dir added, recorded as Hydra would record it."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    GlobalHydra.instance().clear()  # compose_for_run registered what the composition needs
    app = _hydra_app()
    with open_dict(composed):
        composed.hydra.mode = RunMode.RUN
        composed.hydra.run.dir = run_dir
        composed.hydra.overrides.hydra.extend([*pinned, "hydra.mode=RUN"])
    def run() -> None:  # Hydra.run after its compose_config, inside run_and_report as hydra.main has it
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
        callbacks = Callbacks(composed)
        callbacks.on_run_start(config=composed, config_name="config")
        ret = run_job(hydra_context=HydraContext(config_loader=app.config_loader, callbacks=callbacks),
                      task_function=task, config=composed, job_dir_key="hydra.run.dir", job_subdir_key=None,
                      configure_logging=True)
        callbacks.on_run_end(config=composed, config_name="config", job_return=ret)
        _ = ret.return_value  # re-raises what the task raised, for run_and_report to report

    try:
        run_and_report(run)
    finally:
        GlobalHydra.instance().clear()
