"""Each run's config composed once, in the test process, for all the ranks run_ranks forks.

Why: a forked rank used to compose its run's overrides itself (Hydra reads and merges conf/), so a
run at N ranks composed the same config N times: tests/dist/test_moe_training.py's twelve runs at
four ranks took 66.4 CPU-s before and 59.7 after (about 0.2 CPU-s per composition saved, on the
loaded 2-core host). A rank function that takes its configs from composed() says so (@composes_runs:
its `runs` are (overrides, run_dir) pairs); run_ranks (tests/support/ranks.py) composes those runs
before it forks, and the ranks take the config from here: the same compose() of the same overrides
(nothing in conf/ outside the `hydra` node reads the environment or the clock, so where it runs
does not change the config), each caller getting its own deep copy to change as it likes.
A composition that fails in the test process is not kept: the rank composes it again and reports
the error as before. Kept by the overrides alone, for the test process's life: conf/ does not change
in a session, and a config directory a test writes (hydra.searchpath) sits under its own tmp_path.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

_COMPOSED: dict[tuple[str, ...], Any] = {}  # overrides -> TrainConfig, never handed out itself


def composed(overrides: Sequence[str]):
    """compose(overrides)'s TrainConfig: a copy of the one composed before the fork, else composed here."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        from megaframe.config.compose import compose

        return compose(list(overrides))[0]
    return copy.deepcopy(_COMPOSED[key])


def composes_runs(fn: Callable) -> Callable:
    """Mark a rank function whose `runs=` are (overrides, run_dir) pairs whose configs it takes from
    composed(): run_ranks composes them before it forks. A rank function without the mark composes
    for itself, whatever shape its arguments have."""
    fn.composes_runs = True
    return fn


def compose_before_fork(fn: Callable, kwargs: dict[str, Any]) -> None:
    """Compose the runs of a rank function marked @composes_runs that this process has not composed
    yet, so that the forked ranks inherit them."""
    if not getattr(fn, "composes_runs", False):
        return
    from megaframe.config.compose import compose
    from megaframe.config.validate import ConfigError

    for overrides, _ in kwargs["runs"]:
        key = tuple(overrides)
        if key not in _COMPOSED:
            try:
                _COMPOSED[key] = compose(list(overrides))[0]
            except ConfigError:
                pass  # the rank composes it and fails there, as it did
