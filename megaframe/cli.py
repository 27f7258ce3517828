"""Command-line entry points. The only module that imports Hydra's composition machinery.

megaframe-train [OVERRIDE ...]
  1. composes the config and validates it (one-line error, exit code 2, before any process group);
  2. asked for more ranks than it was started with and not under a launcher, it re-runs itself
     under torch.distributed.run on this host;
  3. otherwise hands the same overrides to hydra.main, which creates the run dir and calls train().
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf, open_dict

from megaframe.config.schema import TrainConfig
from megaframe.config.store import register_configs
from megaframe.config.validate import ConfigError, Layout, requested_world_size, validate
from megaframe.config.validate import warnings as validate_warnings
from megaframe.paths import conf_dir

PROG = "megaframe-train"
_SELF_LAUNCHED = "MEGAFRAME_SELF_LAUNCHED"  # set for the ranks _self_launch starts
# Hydra's own flags (help, --cfg job, multirun, ...): Hydra handles them, we do not pre-validate.
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-p", "--package",
                "--resolve", "-m", "--multirun", "-cp", "--config-path", "-cn", "--config-name",
                "-cd", "--config-dir", "--shell-completion", "-sc", "--version", "--experimental-rerun")


def _one_line(ex: BaseException) -> str:
    """Hydra/OmegaConf errors are multi-line; users get the key, the problem and the fix in one line."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    cause = ex.__cause__ if isinstance(ex.__cause__, OmegaConfBaseException) else ex
    if isinstance(ex, MissingConfigException) and ex.options:
        group = ex.missing_cfg_file.rsplit("/", 1)[0] if ex.missing_cfg_file else "?"
        name = ex.missing_cfg_file.rsplit("/", 1)[-1] if ex.missing_cfg_file else "?"
        return f"{group}={name}: no such option; available: {', '.join(sorted(ex.options))}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        full_key = getattr(cause, "full_key", None) or getattr(cause, "key", "?")
        known = _known_keys(str(full_key))
        hint = f"; known keys there: {', '.join(known)}" if known else ""
        return f"unknown key '{full_key}'{hint}"
    if isinstance(cause, ValidationError):
        full_key = getattr(cause, "full_key", "?")
        msg = str(getattr(cause, "msg", cause)).splitlines()[0]
        return f"{full_key}: {msg}"
    return " ".join(part.strip() for part in str(ex).splitlines() if part.strip())


def _known_keys(full_key: str) -> list[str]:
    """Field names of the config node that would hold full_key (for 'did you mean' hints)."""
    node = OmegaConf.structured(TrainConfig)
    for part in full_key.split(".")[:-1]:
        node = node.get(part) if OmegaConf.is_dict(node) else None
        if node is None:
            return []
    return list(node.keys()) if OmegaConf.is_dict(node) else []


def _extra_keys(obj, prefix: str = "") -> list[str]:
    """Keys present on the typed config that its dataclass does not declare (added with `+key=`)."""
    declared = {f.name for f in dataclasses.fields(obj)}
    extra = [f"{prefix}{name}" for name in vars(obj) if name not in declared]
    for name in declared:
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            extra += _extra_keys(value, f"{prefix}{name}.")
    return extra


def compose(overrides: Sequence[str]) -> tuple[TrainConfig, str]:
    """Compose conf/ with the overrides; return the typed config and the resolved hydra.run.dir."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            composed = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
            run_dir = str(composed.hydra.run.dir)
            with open_dict(composed):
                del composed["hydra"]
            typed = OmegaConf.to_object(composed)
    except Exception as ex:  # Hydra / OmegaConf composition errors of every kind
        raise ConfigError(_one_line(ex)) from ex
    if extra := _extra_keys(typed):
        # `+key=value` would otherwise attach a key that nothing reads: a typo the user never sees
        known = _known_keys(extra[0])
        raise ConfigError(f"unknown key '{extra[0]}'" + (f"; known keys there: {', '.join(known)}" if known else ""))
    return typed, run_dir


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
    try:
        cfg, run_dir = compose(overrides)
        world = _launcher_world_size() or requested_world_size(cfg)
        layout = validate(cfg, world)
    except ConfigError as err:
        _fail(str(err))
    return cfg, layout, run_dir


def _self_launch(overrides: list[str], world: int, run_dir: str) -> int:
    """Re-run this command as `world` ranks under torch.distributed.run on this host."""
    env = dict(os.environ, **{_SELF_LAUNCHED: "1"})
    # one BLAS thread per rank unless the user chose: ranks would otherwise oversubscribe the cores
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "megaframe.train", *overrides]
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        cmd.append(f"hydra.run.dir={Path(run_dir).resolve()}")
    print(f"{PROG}: launching {world} ranks on this host", flush=True)
    return subprocess.call(cmd, env=env)


def _shared_run_dir(run_dir: str) -> str:
    """Under a launcher every rank must write to rank 0's run dir (timestamps differ per rank)."""
    import torch.distributed as dist

    from megaframe.engine.trainer import init_distributed

    init_distributed()
    holder = [str(Path(run_dir).resolve())]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _task(dict_cfg) -> None:
    """What hydra.main runs: type the config, validate again (cheap), train."""
    from hydra.core.hydra_config import HydraConfig

    from megaframe.checkpoint.universal import CheckpointError
    from megaframe.engine.trainer import train
    from megaframe.tracking.metrics import atomic_write_text

    try:
        cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
        layout = validate(cfg, _launcher_world_size() or requested_world_size(cfg))
    except ConfigError as err:
        _fail(str(err))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if _rank() == 0:
        atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
    try:
        train(cfg, layout, run_dir)
    except CheckpointError as err:  # corrupted / incompatible checkpoint: one line, not a traceback
        _fail(str(err))


def _run_hydra(args: list[str]) -> None:
    import hydra

    register_configs()
    sys.argv = [sys.argv[0], *args]
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_task)()


def train_main(argv: Optional[Sequence[str]] = None) -> None:
    """`megaframe-train`: validate, launch as many ranks as the layout needs, train."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=", 1)[0] in _HYDRA_FLAGS for a in args):
        _run_hydra(args)
        return
    cfg, layout, run_dir = check(args)
    if not os.environ.get(_SELF_LAUNCHED):  # the parent already planned for the ranks it launched
        from megaframe.plan.cli import preflight

        planned = preflight(cfg, layout, args, PROG)  # exits 2 when the layout cannot fit
        if planned is not args:  # parallel=auto chose a layout: the ranks get it as overrides
            args = planned
            cfg, layout, run_dir = check(args)
    # a self-launched rank 0 runs this again: the parent has already warned
    if _rank() == 0 and not os.environ.get(_SELF_LAUNCHED):
        for warning in validate_warnings(cfg, layout):
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    launched = _launcher_world_size() is not None
    if not launched and layout.world_size > 1:
        from megaframe.engine.data_setup import dataset_prefix

        dataset_prefix(cfg.data)  # build the demo corpus once, not in every rank
        sys.exit(_self_launch(args, layout.world_size, run_dir))
    if launched and layout.world_size > 1 and not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={_shared_run_dir(run_dir)}")
    if _rank() != 0:
        args.append("hydra.output_subdir=null")  # rank 0 alone writes .hydra/
    _run_hydra(args)
