"""Each run's config composed once, in the test process, for all the ranks run_ranks forks.

Why: a forked rank used to compose its run's overrides itself (Hydra reads and merges conf/), so a
run at N ranks composed the same config N times: tests/dist/test_moe_training.py's twelve runs at
four ranks took 66.4 CPU-s before and 59.7 after (about 0.2 CPU-s per composition saved, on the
loaded 2-core host). run_ranks (tests/support/ranks.py) composes the runs it is handed (`runs=[(overrides, run_dir), ...]`, `overrides=[...]`) before it
forks, and the rank functions take the config from here: the same compose() of the same overrides
(nothing in conf/ outside the `hydra` node reads the environment or the clock, so where it runs
does not change the config), each caller getting its own deep copy to change as it likes.
A composition that fails in the test process is not kept: the rank composes it again and reports
the error as before. Kept by the overrides alone, for the test process's life: conf/ does not change
in a session, and a config directory a test writes (hydra.searchpath) sits under its own tmp_path.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

_COMPOSED: dict[tuple[str, ...], Any] = {}  # overrides -> TrainConfig, never handed out itself


def composed(overrides: Sequence[str]):
    """compose(overrides)'s TrainConfig: a copy of the one composed before the fork, else composed here."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        from megaframe.config.compose import compose

        return compose(list(overrides))[0]
    return copy.deepcopy(_COMPOSED[key])


def compose_before_fork(kwargs: dict[str, Any]) -> None:
    """Compose the runs in run_ranks' keyword arguments (`runs`, `overrides`) that this process has
    not composed yet, so that the forked ranks inherit them."""
    from megaframe.config.compose import compose
    from megaframe.config.validate import ConfigError

    # `runs` is each test's own shape: (overrides, run_dir) pairs here; other shapes (a rank function's
    # triples, a dict of run dirs) are left to their ranks, which compose as they always did
    runs = kwargs.get("runs")
    wanted = [list(run[0]) for run in runs if _is_overrides_pair(run)] if isinstance(runs, (list, tuple)) else []
    if isinstance(kwargs.get("overrides"), (list, tuple)):
        wanted.append(list(kwargs["overrides"]))
    for overrides in wanted:
        key = tuple(overrides)
        if key not in _COMPOSED:
            try:
                _COMPOSED[key] = compose(overrides)[0]
            except ConfigError:
                pass  # the rank composes it and fails there, as it did


def _is_overrides_pair(run: Any) -> bool:
    """(overrides, run_dir): a list of override strings and one other item."""
    return (isinstance(run, (list, tuple)) and len(run) == 2 and isinstance(run[0], (list, tuple))
            and all(isinstance(o, str) for o in run[0]))
