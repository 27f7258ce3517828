"""The `launcher` group's rules (how ranks start: local, SLURM, Ray, elastic), which validate() runs.

Out of validate.py, next to it rather than in launch/: megaframe-plan validates with them too (the
planner must plan for the job's nodes, and its layout search must keep to layouts that fill SLURM's
nodes), and launch/ sits above plan/ (it runs the planner's preflight), so plan/ cannot reach into
launch/; registering them from launch/ would make validate() skip them wherever launch/ happens not
to be imported (megaframe-plan, tools/recipe_table.py, a test calling validate())."""
from __future__ import annotations

import re
from typing import Optional

from megaframe.config.choices import choice_problem
from megaframe.config.schema import TrainConfig


def check_launcher(cfg: TrainConfig) -> Optional[str]:
    """The `launcher` group: how ranks start."""
    launcher = cfg.launcher
    if err := choice_problem("launcher", launcher.name, ["local", "slurm", "ray"]):
        return err
    if launcher.nodes is not None and launcher.nodes < 1:
        return f"launcher.nodes={launcher.nodes} must be >= 1 (or null: as many as the layout needs)"
    if launcher.cpus_per_task is not None and launcher.cpus_per_task < 1:
        return f"launcher.cpus_per_task={launcher.cpus_per_task} must be >= 1 (or null for SLURM's default)"
    if launcher.connect_timeout_s <= 0:
        return f"launcher.connect_timeout_s={launcher.connect_timeout_s} must be > 0"
    if launcher.cpus_per_worker <= 0 or launcher.gpus_per_worker < 0 or launcher.max_failures < 0:
        return (f"launcher.cpus_per_worker={launcher.cpus_per_worker} must be > 0, launcher.gpus_per_worker="
                f"{launcher.gpus_per_worker} and launcher.max_failures={launcher.max_failures} >= 0")
    return check_sbatch_strings(launcher) or check_launcher_cluster(cfg) or check_elastic(cfg)


# the profiles in conf/cluster/ a refusal offers (plan/profiles.py checks each against the layout)
CLUSTER_CHOICES = "cluster=h100_80g or cluster=a100_80g"


def check_launcher_cluster(cfg: TrainConfig) -> Optional[str]:
    """Jobs whose ranks run elsewhere are planned for those machines, never for the host that
    launches them: cluster=local measures this host (a login node's RAM, or its GPU)."""
    launcher, cluster = cfg.launcher, cfg.cluster
    this_host = cluster.memory_gb is None  # cluster=local's marker: device memory measured here
    if launcher.name == "slurm" and this_host:
        return (f"launcher=slurm: the planner would measure this host (cluster={cluster.name}), not the job's nodes; "
                f"name their profile, {CLUSTER_CHOICES}, or describe them with cluster.gpus_per_node=N "
                f"cluster.memory_gb=GiB")
    if launcher.name == "ray" and launcher.gpus_per_worker > 0 and this_host:
        return (f"launcher=ray with launcher.gpus_per_worker={launcher.gpus_per_worker:g}: the planner would measure "
                f"this host (cluster={cluster.name}), not the workers' GPUs; name their profile, {CLUSTER_CHOICES}, "
                f"or describe them with cluster.gpus_per_node=N cluster.memory_gb=GiB")
    whole_nodes = launcher.name == "slurm" or launcher.min_nodes is not None
    if whole_nodes and cluster.gpus_per_node is None:
        what = "launcher=slurm" if launcher.min_nodes is None else "launcher.min_nodes (an elastic job)"
        return (f"{what} starts cluster.gpus_per_node ranks on each node, and cluster={cluster.name} does not say how "
                f"many; name the nodes' profile, {CLUSTER_CHOICES}, or set cluster.gpus_per_node=N")
    return None


DEFAULT_RDZV_PORT = 29400  # torchrun's own default for c10d
SHORT_TIMEOUT_S = 300.0  # what the elastic warning suggests for train.collective_timeout_s


def check_elastic(cfg: TrainConfig) -> Optional[str]:
    """The elastic keys, and what an elastic job needs of the rest of the config, in one line."""
    launcher = cfg.launcher
    if launcher.max_restarts < 0 or launcher.resize_interval_s <= 0:
        return (f"launcher.max_restarts={launcher.max_restarts} must be >= 0 and launcher.resize_interval_s="
                f"{launcher.resize_interval_s} > 0")
    if launcher.rdzv_last_call_s < 0 or launcher.rdzv_keep_alive_s < 1:
        return (f"launcher.rdzv_last_call_s={launcher.rdzv_last_call_s} must be >= 0 and launcher.rdzv_keep_alive_s="
                f"{launcher.rdzv_keep_alive_s} >= 1 (whole seconds)")
    if launcher.rdzv_endpoint is not None and not re.fullmatch(r"[A-Za-z0-9._-]+(:\d{1,5})?", launcher.rdzv_endpoint):
        return (f"launcher.rdzv_endpoint={launcher.rdzv_endpoint!r} must be HOST or HOST:PORT "
                f"(e.g. node001:{DEFAULT_RDZV_PORT})")
    if not launcher.min_nodes is not None:
        return None
    if launcher.min_nodes < 1 or launcher.nodes is None or launcher.nodes < launcher.min_nodes:
        return (f"launcher.min_nodes={launcher.min_nodes} needs launcher.nodes (the most nodes) >= it and >= 1, "
                f"e.g. launcher.min_nodes=2 launcher.nodes=4")
    if launcher.name == "ray" and launcher.max_failures < 1:
        return ("launcher=ray launcher.min_nodes: Ray Train restarts the worker group at a new size only after a "
                "failure it may retry; set launcher.max_failures >= 1 (e.g. 10)")
    if cfg.train.resume != "auto":
        return (f"launcher.min_nodes: an elastic job resumes every attempt from its newest checkpoint; "
                f"set train.resume=auto (it is {cfg.train.resume!r})")
    if not cfg.train.universal_checkpoint:
        return ("launcher.min_nodes: an elastic job resumes into a new data-parallel size, which needs the "
                "layout-free checkpoint; set train.universal_checkpoint=true")
    return None


def timeout_warning(cfg: TrainConfig) -> Optional[str]:
    if cfg.launcher.min_nodes is not None and cfg.train.collective_timeout_s > SHORT_TIMEOUT_S:
        return (f"train.collective_timeout_s={cfg.train.collective_timeout_s:g}: in an elastic job a peer that hangs "
                f"(rather than dies) holds the others this long before the job resizes; set "
                f"train.collective_timeout_s={SHORT_TIMEOUT_S:g}")
    return None


def _unprintable(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


# sbatch's --time forms (man sbatch): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; "infinite" and "unlimited" (any case) for no limit
_SLURM_TIME = re.compile(r"\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+|(?i:infinite|unlimited)")


def check_sbatch_strings(launcher) -> Optional[str]:
    """What launcher=slurm writes into #SBATCH lines, which sbatch reads itself (no shell quoting
    applies): a newline would start a line of the caller's choosing (and sbatch ignores every
    #SBATCH after a non-comment line), whitespace ends a value."""
    for key in ("job_name", "partition", "account", "time"):
        value = getattr(launcher, key)
        if value is not None and (_unprintable(str(value)) or any(c.isspace() for c in str(value)) or not str(value)):
            return (f"launcher.{key}={str(value)!r}: a job script value must be one word of printable "
                    f"characters (no spaces, tabs or newlines)")
    if launcher.time is not None and not _SLURM_TIME.fullmatch(str(launcher.time)):
        # sbatch refuses the script only once the job is submitted, in its own words
        return (f"launcher.time={launcher.time}: not a SLURM time limit; give MINUTES, MM:SS, HH:MM:SS, D-HH, "
                f"D-HH:MM, D-HH:MM:SS or UNLIMITED, e.g. launcher.time=2-00:00:00")
    for extra in launcher.sbatch_extra:
        if _unprintable(str(extra)) or not str(extra).startswith("--"):
            return (f"launcher.sbatch_extra entry {str(extra)!r}: each must be one sbatch option such as "
                    f"'--qos=high' (starting with --, no newlines or control characters)")
    return None


def check_slurm_nodes(cfg: TrainConfig, world_size: int) -> Optional[str]:
    """launcher=slurm without launcher.nodes: the job is whole nodes, or part of one (srun runs the
    same number of tasks on every node, and each task's LOCAL_WORLD_SIZE says so)."""
    launcher, per_node = cfg.launcher, cfg.cluster.gpus_per_node
    if launcher.name != "slurm" or launcher.nodes is not None or per_node is None or world_size <= per_node \
            or world_size % per_node == 0:
        return None
    return (f"launcher=slurm: the layout's {world_size} ranks do not fill nodes of cluster.gpus_per_node={per_node}; "
            f"make the world a multiple of {per_node}, or at most {per_node}")
