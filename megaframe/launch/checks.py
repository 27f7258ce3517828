"""What megaframe-train checks before any rank starts: composition and validation at the world it
would launch (an elastic job at every world of its range), the launcher's needs on this host, the
dataset's files, the run dir's history, the machine (offload, AutoEP). Bad input is one line on
stderr and exit code 2 (docs/failures.md)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from megaframe.backends.registry import engine, validate_for_engine
from megaframe.config.compose import compose_for_run
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError, Layout, requested_world_size
from megaframe.config.validate import warnings as validate_warnings
from megaframe.common.failures import PROG
from megaframe.launch.base import fail, launcher_world_size, rank
from megaframe.launch.registry import launcher


def check(overrides: Sequence[str]) -> tuple[TrainConfig, Layout, str]:
    """Compose and validate; exits with code 2 and a one-line message on bad input."""
    cfg, layout, run_dir, _ = check_composed(overrides)
    return cfg, layout, run_dir


def check_composed(overrides: Sequence[str]) -> tuple[TrainConfig, Layout, str, DictConfig]:
    """check(), and also Hydra's whole composition, which a one-process run hands to hydra_run.run_composed."""
    from megaframe.launch.slurm import job_world_size as slurm_world_size
    from megaframe.plan.search import validated_to_search

    try:
        cfg, run_dir, composed = compose_for_run(overrides)
        if launcher_world_size() is None and cfg.launcher.min_nodes is not None:
            from megaframe.launch.elastic import check_range

            check_range(cfg, overrides)
        world = launcher_world_size() or slurm_world_size(cfg) or requested_world_size(cfg)
        cfg, layout, note = validated_to_search(cfg, world, validate_for_engine)  # parallel=auto: the search's start
        if note and rank() == 0:
            print(f"{PROG}: {note}", flush=True)
    except ConfigError as err:
        fail(str(err))
    return cfg, layout, run_dir, composed


def dataset_problem(cfg: TrainConfig) -> Optional[str]:
    """Open data.path's files before launch (headers, sizes, metadata; the token scan runs after
    launch, shared by the ranks) and split them as the ranks will (memory maps and views: too few
    tokens for one sample on either side, sources built with different tokenizers): what is wrong,
    in one line, or None."""
    from megaframe.data import DataError
    from megaframe.data.blend import parse_blend
    from megaframe.data.index_scan import walks_remembered
    from megaframe.training.data_setup import build_data

    try:
        prefixes = [prefix for prefix in (cfg.data.path, cfg.data.valid_path) if prefix is not None]
        for blend, key in ((cfg.data.blend, "data.blend"), (cfg.data.valid_blend, "data.valid_blend")):
            prefixes += parse_blend(list(blend), key)[1] if blend else []
        if prefixes:  # opened once, as the ranks open them; the built-in corpus is built after launch
            with walks_remembered():  # what the indexes' walks found, for this process's trainer
                build_data(cfg.data, cfg.model.seq_length)
        else:
            return demo_cache_problem(cfg.data.cache_dir)
    except DataError as err:
        return str(err)
    return None


def demo_cache_problem(configured: Optional[str]) -> Optional[str]:
    """The built-in corpus is written to the cache (data.cache_dir, else $XDG_CACHE_HOME or ~/.cache)
    after launch: a cache that cannot be made or written ended rank 0 with NotADirectoryError (exit 1).
    One that holds it already is only read (a shared cache made read-only)."""
    from megaframe.common.paths import cache_dir
    from megaframe.data.demo import demo_built

    where = cache_dir(configured)
    if demo_built(where):
        return None
    try:
        where.mkdir(parents=True, exist_ok=True)
        writable = os.access(where, os.W_OK | os.X_OK)
        reason = "not writable"
    except OSError as err:
        writable, reason = False, err.strerror or str(err)
    if writable:
        return None
    named = "data.cache_dir" if configured else ("XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "HOME")
    return (f"the built-in corpus is cached in {where} ({named}), which cannot be used ({reason}); set "
            f"data.cache_dir to a folder you can write, or train on your own data with data.path")


def launcher_problem(cfg: TrainConfig) -> Optional[str]:
    """What this host lacks for cfg.launcher (Ray's package, SLURM's sbatch), in one line, or None."""
    return launcher(cfg.launcher.name).host_problem(cfg)


def check_resume(cfg: TrainConfig, run_dir: str) -> None:
    """A run dir that would start over on top of an earlier run's history (its checkpoints not
    mounted, a file in their place: checkpoint/resume_checks.py) is one line and exit code 2, before
    launch; every rank of a launched job exits, rank 0 says why."""
    from megaframe.checkpoint.resume_checks import prelaunch_problem

    if problem := prelaunch_problem(Path(run_dir), cfg.train.resume):
        if rank() == 0:
            print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)


def check_system(cfg: TrainConfig, layout: Layout) -> None:
    """What the machine must provide for this layout (DeepSpeed's AutoEP for ZeRO-3 experts) and
    offload setting (libaio, a compiler, NVMe space), before any rank starts: one line and exit
    code 2 when something is missing."""
    if cfg.zero.stage == 3 and cfg.parallel.ep > 1:
        if problem := engine(cfg.backend.name).expert_parallel_problem(cfg.zero.stage, cfg.parallel.ep):
            fail(problem)
    if cfg.offload.optimizer == "none" and cfg.offload.param == "none":
        return
    from megaframe.plan.estimate import estimate_config

    ranks_here = ranks_on_this_host(cfg, layout)
    try:  # what goes to the drive: offloaded states less those offload=cpu keeps in RAM
        swap_bytes = max(st.states.host - st.states.host_ram for st in estimate_config(cfg, layout).stages) * ranks_here
    except ConfigError:  # the planner cannot size this model: check the pieces, not the space
        swap_bytes = 0.0
    if problem := engine(cfg.backend.name).system_problem(cfg.offload, swap_bytes):
        fail(problem)


RUN_DIR_MIN_FREE = 1 << 20  # below a MiB free, the run's first writes (config.yaml, logs) fail


def run_dir_space_problem(run_dir: str) -> Optional[str]:
    """A run dir on a disk that is full: the first write (config.yaml) was a Hydra traceback, exit 1
    (review: the resume command a full disk's exit 8 printed, run before freeing space)."""
    from megaframe.common.paths import nearest_existing

    try:  # the run dir may not exist yet
        free = shutil.disk_usage(nearest_existing(Path(run_dir))).free
    except OSError:
        return None  # the run dir's own checks say what is wrong with it
    if free < RUN_DIR_MIN_FREE:
        return (f"run dir {run_dir}: its disk has {free:,} bytes free, too few for the run's first files; free "
                f"space there (train.resume=auto then continues from the newest checkpoint) or choose another "
                f"run dir (hydra.run.dir=...)")
    return None


def fast_tier_space_problem(cfg: TrainConfig, layout: Layout, run_dir: str) -> Optional[str]:
    """train.fast_save_interval: room in train.fast_save_dir (node memory, /dev/shm: 64 MB in a default
    container) for what this host's ranks keep there, FAST_TIER_PARTS parts each at their peak
    (plan/host.py), counting this run's parts already there as room (a restart replaces them). Found
    full, it failed the first fast save with exit 8, minutes into the run. Checked where the ranks
    run: by each rank under an external launcher (srun, torchrun, a node's elastic agent), by
    megaframe-train for the ranks it starts on this host; not on a host that only submits the job or
    prints an elastic job's node command."""
    if not cfg.train.fast_save_interval:
        return None
    if launcher_world_size() is None and (cfg.launcher.name != "local" or cfg.launcher.min_nodes is not None):
        return None
    from megaframe.checkpoint.fast_tier import run_key
    from megaframe.common.paths import nearest_existing
    from megaframe.plan.estimate import estimate_config
    from megaframe.plan.host import FAST_TIER_PARTS

    try:
        per_rank = estimate_config(cfg, layout).host.fast_tier
    except ConfigError:  # the planner cannot size this model: nothing to compare with
        return None
    ranks_here = ranks_on_this_host(cfg, layout)
    where = nearest_existing(Path(cfg.train.fast_save_dir))
    try:
        free = shutil.disk_usage(where).free
    except OSError:  # unreadable: the fast tier's own checks say why, at its first save
        return None
    ours = Path(cfg.train.fast_save_dir) / run_key(Path(run_dir))
    free += sum(f.stat().st_size for f in ours.rglob("*") if f.is_file() and not f.is_symlink()) \
        if ours.is_dir() and not ours.is_symlink() else 0
    if free >= per_rank * ranks_here:
        return None
    return (f"train.fast_save_dir={cfg.train.fast_save_dir}: {free / 2**30:.2f} GiB free in {where}, and the fast "
            f"tier keeps up to {per_rank * ranks_here / 2**30:.2f} GiB there ({ranks_here} rank"
            f"{'s' if ranks_here > 1 else ''} x {FAST_TIER_PARTS} checkpoint parts of "
            f"{per_rank / FAST_TIER_PARTS / 2**30:.2f} GiB); give it more room (a container's /dev/shm: docker "
            f"--shm-size), another node-local directory, or train.fast_save_interval=0")


def ranks_on_this_host(cfg: TrainConfig, layout: Layout) -> int:
    """The ranks that share this host: the launcher's LOCAL_WORLD_SIZE; else, under a launcher that
    did not set it, a node's (cluster.gpus_per_node) when known; else every rank (all started here)."""
    if local := os.environ.get("LOCAL_WORLD_SIZE"):
        return int(local)
    if launcher_world_size() is not None and cfg.cluster.gpus_per_node:
        return min(layout.world_size, cfg.cluster.gpus_per_node)
    return layout.world_size


def check_before_launch(cfg: TrainConfig, layout: Layout, run_dir: str) -> None:
    """The launcher's package or command, an online W&B run's key, the dataset, the run dir's
    history and the machine, in that order; then rank 0 prints the config's warnings."""
    from megaframe.tracking.wandb_run import (env_mode_problem, env_settings_problem, online_key_problem,
                                              project_problem, wandb_mode)

    mode = wandb_mode(cfg.logging.wandb.mode)
    configured = cfg.logging.wandb.mode is not None
    named = None if configured else f"WANDB_MODE={os.environ.get('WANDB_MODE')} (in the environment)"
    if problem := launcher_problem(cfg) or env_mode_problem(mode, configured=configured) \
            or project_problem(cfg.logging.wandb.project, mode) or env_settings_problem(mode) \
            or online_key_problem(mode, named=named):
        fail(problem)
    if problem := dataset_problem(cfg):
        fail(problem)
    check_resume(cfg, run_dir)
    check_system(cfg, layout)
    if problem := run_dir_space_problem(run_dir):
        fail(problem)
    if problem := fast_tier_space_problem(cfg, layout, run_dir):
        if os.environ.get("LOCAL_RANK", "0") != "0":  # the node's problem: its local rank 0 says it
            sys.exit(2)
        fail(problem)
    if rank() == 0:
        for warning in validate_warnings(cfg, layout, engine(cfg.backend.name).config_warnings):
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
