"""`megaframe-train -m`: every point of a sweep is composed, validated and planned before the first
one launches, so a typo or a layout that cannot run is one line and exit code 2, not a sweep that
fails half-way (or Hydra's multi-line report). What only a run can tell (a diverging learning rate,
a killed rank) still fails that point alone; the launcher's summary shows it."""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from megaframe.config.validate import ConfigError


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """The points Hydra's basic sweeper runs, in its order: the product of the sweep overrides
    (`key=a,b`, `choice(...)`, `range(...)`), the last one varying fastest."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as ex:
        raise ConfigError(" ".join(str(ex).split())) from ex
    choices = []
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices.append([f"{key}={override.get_value_element_as_str()}"])
        elif override.is_discrete_sweep():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            raise ConfigError(f"{key}: an interval sweep needs an optimising sweeper (Optuna, Nevergrad); "
                              f"megaframe's sweeps take lists, choice() or range()")
    return [list(point) for point in itertools.product(*choices)]


def check_sweep(overrides: Sequence[str], check_point: Callable[[list[str]], None]) -> int:
    """Run check_point (compose, validate, plan: raises ConfigError) on every point; the error names
    the point by the values that vary. Returns the number of points."""
    try:
        points = sweep_points(overrides)
    except ConfigError as err:
        raise ConfigError(f"{err}; nothing was launched") from err
    varying = [i for i in range(len(points[0]) if points else 0) if len({p[i] for p in points}) > 1]
    for index, point in enumerate(points):
        try:
            check_point(point)
        except ConfigError as err:
            named = " ".join(point[i] for i in varying)
            raise ConfigError(f"sweep point {index}{f' ({named})' if named else ''}: {err}; nothing was launched") \
                from err
    return len(points)


def check_sweep_point(point: list[str]) -> None:
    """One point of a -m sweep, as megaframe-train alone would check it before launching its ranks
    (compose, validate, the planner's fit, the launcher's package, the dataset's files)."""
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose_for_run, hydra_plugin_problem
    from megaframe.config.validate import requested_world_size
    from megaframe.launch.checks import dataset_problem, launcher_problem
    from megaframe.launch.slurm import job_world_size as slurm_world_size
    from megaframe.plan.estimate import estimate_config
    from megaframe.plan.profiles import profile_hint
    from megaframe.plan.report import verdict
    from megaframe.plan.search import validated_to_search

    cfg, _, composed = compose_for_run(point)
    if problem := hydra_plugin_problem(composed.hydra):
        raise ConfigError(problem)
    world = slurm_world_size(cfg) or requested_world_size(cfg)
    # parallel=auto: a layout given that the world cannot divide is the search's to replace, as in a plain run
    cfg, layout, _ = validated_to_search(cfg, world, lambda c, w: validate_for_engine(c, w, ask_bf16=False))
    if cfg.plan.check and not cfg.parallel.auto and not (est := estimate_config(cfg, layout)).fits:
        raise ConfigError(f"the planner says this will not fit: {verdict(est)}{profile_hint(cfg, layout) or ''} "
                          f"(plan.check=false skips this check)")
    if problem := launcher_problem(cfg) or dataset_problem(cfg):
        raise ConfigError(problem)


def check_args(args: list[str]) -> None:
    """`-m` (and no other Hydra flag): every point is checked before the first launches; one line, exit 2."""
    from megaframe.launch.base import fail, hydra_flags

    flags = hydra_flags(args)
    if not flags or not flags <= {"-m", "--multirun"}:
        return
    try:
        check_sweep([a for a in args if a not in flags], check_sweep_point)
    except ConfigError as err:
        fail(str(err))
    if problem := sweep_dir_problem(args):
        fail(problem)


def sweep_dir_problem(args: list[str]) -> str | None:
    """A hydra.sweep.dir that cannot be made (a file there, a read-only place), in one line, as
    hydra.run.dir's is: Hydra's own attempt ended in a traceback. Made here, as Hydra would make it."""
    from pathlib import Path

    from megaframe.config.compose import override_value

    given = [a for a in args if a.startswith("hydra.sweep.dir=")]
    if not given:
        return None
    # the value as Hydra reads it: quoted ('/scratch/my sweep', as hydra_quoted writes), escaped
    folder = override_value(given[-1])
    if "${" in folder:  # an interpolation only Hydra resolves (its default, ${now:...})
        return None
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"hydra.sweep.dir={folder}: cannot create the sweep directory ({err.strerror}); choose another"
    return None
