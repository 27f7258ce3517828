"""`megaframe-plan [--json] [--dry-run=RANK] [--config-dir DIR] [OVERRIDE ...]`: will this layout fit,
and which layouts would?

Same composition and validation as megaframe-train (one-line errors, exit code 2). The world size
is launcher.nodes x cluster.gpus_per_node when both are set, otherwise tp*pp*cp*dp of the config.
Also the pre-launch gate megaframe-train calls: preflight() applies parallel=auto and refuses a
layout that does not fit before any rank starts.
"""
from __future__ import annotations

import contextlib

import sys
from typing import Optional, Sequence

from megaframe.common.ctrl_c import interrupted_in_one_line
from megaframe.common.result_output import printed_to_stdout, require_stdout
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError, Layout, requested_world_size
from megaframe.plan.estimate import Estimate, estimate_config, plan_layout
from megaframe.plan.profiles import profile_hint
from megaframe.plan.report import as_json, gib, host_line, table, verdict
from megaframe.plan.search import fitting_layouts, layout_overrides, validated_to_search

PROG = "megaframe-plan"
# --dry-run builds blocks as modules; the deepest real models have ~100 blocks a stage, ~130 in all
DRY_RUN_MAX_BLOCKS = 10_000


def planned_world_size(cfg: TrainConfig, launched: Optional[int] = None) -> int:
    """Ranks the plan is for: a launcher's world, the job's nodes x the cluster's GPUs per node, or
    tp*pp*cp*dp."""
    if launched:
        return launched
    nodes, per_node = cfg.launcher.nodes, cfg.cluster.gpus_per_node
    if nodes is not None and per_node is not None:
        return nodes * per_node
    return requested_world_size(cfg)


def _check_cluster(cfg: TrainConfig) -> None:
    c = cfg.cluster
    if cfg.launcher.nodes is not None and cfg.launcher.nodes < 1:
        raise ConfigError(f"launcher.nodes={cfg.launcher.nodes} must be >= 1 (or null: as many as the layout needs)")
    if c.memory_gb is not None and c.memory_gb <= 0:
        raise ConfigError(f"cluster.memory_gb={c.memory_gb} must be > 0 (or null: this host's RAM)")
    if c.host_memory_gb is not None and c.host_memory_gb <= 0:
        raise ConfigError(f"cluster.host_memory_gb={c.host_memory_gb} must be > 0 (or null: this host's RAM on "
                          f"cluster=local, unchecked on a named cluster)")
    if not 0 < cfg.plan.mfu <= 1:
        raise ConfigError(f"plan.mfu={cfg.plan.mfu} must be in (0, 1], e.g. plan.mfu=0.4")


def plan(cfg: TrainConfig, world: int) -> tuple[Layout, Estimate, Optional[list[Estimate]]]:
    """Validate for `world` ranks and estimate; alternatives when it does not fit or parallel.auto."""
    return _plan(cfg, world)[1:]


def _plan(cfg: TrainConfig, world: int) -> tuple[TrainConfig, Layout, Estimate, Optional[list[Estimate]]]:
    """plan(), and cfg with the layout it was planned from (validated_to_search: parallel=auto may
    start from another, and says so on stderr)."""
    from megaframe.backends.registry import validate_for_engine

    _check_cluster(cfg)
    cfg, layout, note = validated_to_search(cfg, world, lambda c, w: validate_for_engine(c, w, ask_bf16=False))
    if note:
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    est = estimate_config(cfg, layout)
    alternatives = fitting_layouts(cfg, plan_layout(cfg, layout)) if cfg.parallel.auto or not est.fits else None
    return cfg, layout, est, alternatives


def preflight(cfg: TrainConfig, layout: Layout, args: list[str], prog: str) -> list[str]:
    """Before megaframe-train launches: apply parallel=auto (returns the overrides the ranks must get)
    and refuse, with the planner's verdict, a layout the cluster cannot hold (exit code 2)."""
    if not cfg.plan.check and not cfg.parallel.auto:
        return args
    try:
        _check_cluster(cfg)
        est = estimate_config(cfg, layout)
        alternatives = fitting_layouts(cfg, plan_layout(cfg, layout), limit=1) if cfg.parallel.auto or not est.fits else []
    except ConfigError as err:
        _fail(prog, str(err))
    if cfg.parallel.auto:
        if not alternatives:
            _fail(prog, f"parallel=auto: no layout of {layout.world_size} ranks fits cluster={cfg.cluster.name} "
                        f"{_auto_capacity(est)}{host_fixes(est)}{_on_a_profile(cfg, layout)}")
        chosen = alternatives[0].layout
        print(f"{prog}: parallel=auto chose {chosen.describe()} (peak {gib(alternatives[0].peak)})", flush=True)
        return [*args, *layout_overrides(chosen)]
    if not est.fits:
        best = f"; a layout that fits: {alternatives[0].layout.describe()}" if alternatives else f"; {no_fit(est)}"
        best += host_fixes(est)
        _fail(prog, f"the planner says this will not fit: {verdict(est)}{best}{profile_hint(cfg, layout) or ''} "
                    f"(plan.check=false skips this check)")
    return args


def host_fixes(est: Estimate) -> str:
    """What lowers the host memory the ranks keep, where that is what does not fit (plan/host.py)."""
    from megaframe.backends.registry import engine_facts

    host = est.host
    if host is None or host.fits:
        return ""
    nvme = est.layout.zero_stage in engine_facts(est.layout.engine).nvme_offload_stages
    fixes = [fix for fix, term in (("train.async_save=false", host.async_copies),
                                   ("offload=nvme offload.nvme_path=DIR", host.offloaded if nvme else 0.0),
                                   ("train.fast_save_interval=0", host.fast_tier)) if term]
    parts = [f"keep less in host memory ({', '.join(fixes)})"] if fixes else []
    if est.cluster != "local":
        parts.append("set cluster.host_memory_gb to the nodes' RAM if it is more")
    return "; or " + ", or ".join(parts) if parts else ""


def no_fit(est: Estimate) -> str:
    """Why no layout of this world fits, and what would help: more devices and a smaller micro-batch
    for the devices' memory; for the host's alone, more nodes (each rank's share of the states shrinks)."""
    if est.fits_devices:  # the verdict before this has said what fills the host memory
        return f"no layout of this many ranks fits the host memory{_more_nodes(est)}"
    return "no layout of this many ranks fits (add devices or shrink parallel.micro_batch_size)"


def _more_nodes(est: Estimate) -> str:
    """On a cluster, more nodes split the states over more hosts; cluster=local is one host."""
    return "" if est.cluster == "local" else " (more nodes shrink each rank's share)"


def _auto_capacity(est: Estimate) -> str:
    """parallel=auto found nothing: the memory that stopped it, the devices' or the host's."""
    host_short = est.host is not None and not est.host.fits
    if est.fits_devices and host_short:
        more = "" if est.cluster == "local" else "; more nodes shrink each rank's share"
        return f"(the host memory: {host_line(est.host)}){more}"
    also = f", nor the host memory ({host_line(est.host)})" if host_short else ""
    return f"({gib(est.capacity)} per device{also}); add devices or shrink parallel.micro_batch_size"


def _on_a_profile(cfg: TrainConfig, layout: Layout) -> str:
    """parallel=auto found nothing here: the profiles on which the starting layout fits, if any."""
    hint = profile_hint(cfg, layout)
    return f", or plan for the job's machines{hint.replace(';', ':', 1)}" if hint else ""


def fit_problem(cfg: TrainConfig, layout: Layout) -> Optional[str]:
    """Why the planner finds that this layout (or, with parallel=auto, any layout of its world) does
    not fit, or None; None also when plan.check=false and no parallel=auto (preflight's rule)."""
    if not cfg.plan.check and not cfg.parallel.auto:
        return None
    _check_cluster(cfg)
    est = estimate_config(cfg, layout)
    if cfg.parallel.auto:
        if fitting_layouts(cfg, plan_layout(cfg, layout), limit=1):
            return None
        return (f"parallel=auto: no layout of {layout.world_size} ranks fits cluster={cfg.cluster.name} "
                f"{_auto_capacity(est)}")
    return None if est.fits else f"the planner says it will not fit: {verdict(est)}{profile_hint(cfg, layout) or ''}"


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _dry_run_flag(args: list[str]) -> tuple[list[str], Optional[int]]:
    """`--dry-run=RANK`: also build rank RANK's shard on the meta device and count it."""
    ranks = [a.split("=", 1)[1] for a in args if a.startswith("--dry-run=")]
    rest = [a for a in args if not a.startswith("--dry-run=")]
    if ranks and not ranks[-1].isdigit():
        _fail(PROG, f"--dry-run={ranks[-1]}: give a rank number, e.g. --dry-run=0")
    return rest, int(ranks[-1]) if ranks else None


def dry_run_report(cfg: TrainConfig, layout: Layout, rank: int) -> dict:
    """The meta-device build of `rank` by its engine next to the planner's count for that rank."""
    from megaframe.model.dims import resolve_dims
    from megaframe.plan.estimate import planning_device_type, planning_vocab_size, rank_parameters

    if not 0 <= rank < layout.world_size:
        raise ConfigError(f"--dry-run={rank}: the layout has ranks 0..{layout.world_size - 1}")
    dims = resolve_dims(cfg.model, planning_vocab_size(cfg), tp=layout.tp, device_type=planning_device_type(cfg))
    # a whole model, and FSDP2's pipeline ranks (they cut the model built whole), build every block
    blocks = dims.num_layers
    if blocks > DRY_RUN_MAX_BLOCKS:  # model.num_layers=100000000 --dry-run=0 took 20 GB before the OOM killer came
        raise ConfigError(f"--dry-run={rank}: the model holds {blocks:,} blocks, each built as Python modules on the "
                          f"meta device (beyond {DRY_RUN_MAX_BLOCKS:,} that takes minutes and gigabytes); drop "
                          f"--dry-run (the table counts them by kind) or check model.num_layers for a typo")
    from megaframe.plan.dryrun import dry_run  # torch and the model: imported once the checks have passed

    p = cfg.parallel
    built = dry_run(dims, layout.grid, rank, p.pipeline_partition, cfg.backend.name, p.pipeline_schedule,
                    p.virtual_stages)
    planned = rank_parameters(dims, plan_layout(cfg, layout), built.stage)
    return {"rank": rank, "stage": built.stage, "stages": list(built.stages), "tp_rank": built.tp_rank,
            "layers": built.layers, "parameters": built.parameters, "planner_parameters": planned}


def main(argv: Optional[Sequence[str]] = None) -> None:
    with interrupted_in_one_line(PROG):
        _main(argv)


def _main(argv: Optional[Sequence[str]]) -> None:
    from megaframe.config.compose import compose, config_dirs_as_searchpath

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return
    want_json = "--json" in args
    require_stdout(PROG)
    args, dry_rank = _dry_run_flag([a for a in args if a != "--json"])
    try:
        overrides = config_dirs_as_searchpath(args)
        if flags := [a for a in overrides if a.startswith("-")]:  # Hydra's lexer: "LexerNoViableAltException: -m"
            sweep = flags[0] in ("-m", "--multirun")
            raise ConfigError(f"{flags[0]}: " + (
                "megaframe-plan plans one layout; parallel=auto ranks the layouts that fit, or plan each point of "
                "the sweep on its own" if sweep else "not an option; megaframe-plan takes --json, --dry-run=RANK, "
                "--config-dir DIR and KEY=VALUE overrides"))
        # DeepSpeed logs to stdout (on a CPU-only login node: "Setting accelerator to CPU"); stdout
        # must hold only the report, so that `megaframe-plan --json | jq` parses.
        with contextlib.redirect_stdout(sys.stderr):
            cfg, _ = compose(overrides)
            cfg, layout, est, alternatives = _plan(cfg, planned_world_size(cfg))
            dry = dry_run_report(cfg, layout, dry_rank) if dry_rank is not None else None
    except ConfigError as err:
        _fail(PROG, str(err))
    auto = alternatives[0] if cfg.parallel.auto and alternatives else None
    with printed_to_stdout(PROG):  # `| head`, a full disk behind a redirect: no traceback
        if want_json or cfg.plan.json:
            print(as_json(est, cfg.plan.mfu, alternatives, auto, dry))
            return
        print(table(est, cfg.plan.mfu, alternatives, auto))
        if dry is not None:
            layers = dry["layers"] if len(dry["layers"]) <= 6 else [*dry["layers"][:3], "...", *dry["layers"][-2:]]
            stages = f"stage {dry['stage']}" if len(dry["stages"]) == 1 else \
                f"pipeline rank {dry['stage']} (stages {', '.join(map(str, dry['stages']))})"
            print(f"\ndry run (meta device, no process group): rank {dry['rank']} = {stages}, tp rank "
                  f"{dry['tp_rank']}: {', '.join(layers)}; {dry['parameters']:,} parameters "
                  f"(planner: {dry['planner_parameters']:,})")


if __name__ == "__main__":
    main()
