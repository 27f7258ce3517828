"""The launcher of `megaframe-train -m` sweeps (the default, `hydra/launcher=megaframe_local`).

Hydra's basic launcher calls the task in its own process, one point after another: a point with
parallel.dp=2 then finds a world of one. Here every point is a whole `megaframe-train` run of its
own: validated and planned before launch, started with as many ranks as its layout needs, in its
own run directory (hydra.sweep.dir/hydra.sweep.subdir). Points run one after another; at the end a
table of the points (exit code, last loss and eval loss) is printed and written, atomically, to
SWEEP_DIR/sweep_summary.json. The sweep exits with the first failed point's exit code.

A stop signal to the sweep (Ctrl-C, SIGTERM, SIGHUP, SIGUSR1) goes to the running point once, which
saves and exits 128 + the signal's number as a run does; the sweep then writes the table and exits
with that code, starting no further point. Each point runs in a session of its own (a terminal's
Ctrl-C reaches the sweep, which passes it on, rather than both) and dies with the sweep when the
sweep is killed outright (its ranks die with it in turn).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from megaframe.config.compose import hydra_quoted, searchpath_override


@dataclass
class MegaframeLocalLauncherConf:
    _target_: str = "hydra_plugins.megaframe_launcher.local_launcher.MegaframeLocalLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="megaframe_local", node=MegaframeLocalLauncherConf,
                             provider="megaframe")


class MegaframeLocalLauncher(Launcher):
    """Each sweep point as its own `python -m megaframe.train` on this host."""

    def __init__(self) -> None:
        super().__init__()
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns, rows = [], []
        # a user's config directories (--config-dir, which megaframe-train passes on as
        # hydra.searchpath): filter_overrides drops hydra.* keys, and without them a point composing
        # an option of that directory failed with "no such option"
        searchpath = [str(entry) for entry in self.config.hydra.searchpath or []]
        search = [searchpath_override(searchpath)] if searchpath else []
        with _Stops() as stops:
            for offset, overrides in enumerate(job_overrides):
                idx = initial_job_idx + offset
                if stops.stopped_by is not None:  # came between two points
                    self._say_stopped(stops.stopped_by, f"before point {idx}", len(job_overrides) - offset)
                    break
                sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(sweep_config):
                    sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
                run_dir = sweep_dir / str(sweep_config.hydra.sweep.subdir)
                point = list(filter_overrides(overrides))
                print(f"megaframe-train: sweep point {idx}: {' '.join(point)} -> {run_dir}", flush=True)
                code = stops.run([sys.executable, "-m", "megaframe.train", *point, *search,
                                  f"hydra.run.dir={hydra_quoted(str(run_dir))}"])
                rows.append({"point": idx, "overrides": point, "run_dir": str(run_dir), "exit_code": code,
                             **_last_values(run_dir / "metrics.jsonl")})
                returns.append(JobReturn(overrides=list(overrides), cfg=sweep_config, working_dir=str(run_dir),
                                         task_name=str(sweep_config.hydra.job.name), status=JobStatus.COMPLETED,
                                         _return_value=code))
                if stops.stopped_by is not None:
                    self._say_stopped(stops.stopped_by, f"during point {idx}", len(job_overrides) - offset - 1)
                    break
            _write_summary(sweep_dir / "sweep_summary.json", rows)
            print(_table(rows), flush=True)
        if stops.stopped_by is not None:  # the stopped point's code (128 + the signal), not an earlier failure's
            from megaframe.training.stop_signal import exit_code

            sys.exit(rows[-1]["exit_code"] if rows and rows[-1]["exit_code"] else exit_code(stops.stopped_by))
        failed = [row["exit_code"] for row in rows if row["exit_code"]]
        if failed:
            sys.exit(failed[0])
        return returns

    @staticmethod
    def _say_stopped(signum: int, when: str, left: int) -> None:
        print(f"megaframe-train: sweep stopped by {signal.Signals(signum).name} {when}"
              + (f"; {left} point(s) did not start" if left else ""), file=sys.stderr, flush=True)


class _Stops:
    """The sweep's stop signals (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, less those ignored) for as
    long as its points run, between points too: each is passed on once to the running point, and
    once one came no further point starts. subprocess.call would SIGKILL the point 0.25 s after a
    Ctrl-C (its ranks mid-save) and leave it training on after a SIGTERM."""

    def __init__(self) -> None:
        self.child: Optional[subprocess.Popen] = None
        self.received: list[int] = []
        self.pending = False  # a signal that came while no point was running (or one was starting)

    def __enter__(self) -> "_Stops":
        from megaframe.launch.local import AGENT_SIGNALS
        from megaframe.training.stop_signal import not_ignored

        handled = not_ignored(signal.Signals[name] for name in AGENT_SIGNALS)
        self.previous = {signum: signal.signal(signum, self._pass_on) for signum in handled}
        return self

    def __exit__(self, *exc) -> None:
        from megaframe.common.startup_signals import default_in_place_of_startup

        for signum, handler in self.previous.items():
            signal.signal(signum, default_in_place_of_startup(handler))

    @property
    def stopped_by(self) -> Optional[int]:
        return self.received[0] if self.received else None

    def _pass_on(self, signum: int, _frame) -> None:
        self.received.append(signum)
        if self.child is None:
            self.pending = True
            return
        try:
            self.child.send_signal(signum)  # a second one too: the point's "again: stopping now"
        except ProcessLookupError:
            pass

    def run(self, argv: list[str]) -> int:
        """Run one point to its end and return its exit code. A point a signal killed outright (the OOM
        killer) counts as exit 1, as a killed rank does."""
        from megaframe.launch.guard import die_with_parent
        from megaframe.training.stop_signal import exit_code

        sweep = os.getpid()
        child = subprocess.Popen(argv, start_new_session=True, preexec_fn=lambda: die_with_parent(sweep))
        self.child = child  # (signal handlers run between bytecodes: one came before this line is pending)
        if self.pending:
            self.pending = False
            child.send_signal(self.received[0])
        try:
            code = child.wait()
        finally:
            self.child = None
        if code < 0:
            print(f"megaframe-train: sweep point killed by {signal.Signals(-code).name} [exit 1]", file=sys.stderr,
                  flush=True)
            code = 1
        if self.stopped_by is not None and code == 0:  # it ended before it saw the signal
            code = exit_code(self.stopped_by)
        return code


def run_point(argv: list[str]) -> tuple[int, Optional[int]]:
    """One point run on its own (the tests'): (its exit code, the stop signal that came meanwhile or None)."""
    with _Stops() as stops:
        return stops.run(argv), stops.stopped_by


def _last_values(metrics: Path) -> dict:
    """The last logged loss and eval loss of a point (None where it logged none)."""
    values = {"loss": None, "eval_loss": None, "step": None}
    if not metrics.exists():
        return values
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # the line a point killed mid-write left torn
            continue
        if not isinstance(record, dict):
            continue
        for key in ("loss", "eval_loss", "step"):
            if key in record:
                values[key] = record[key]
    return values


def _write_summary(path: Path, rows: list[dict]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sweep_summary.")
    with os.fdopen(fd, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, path)


def _table(rows: list[dict]) -> str:
    def number(value) -> str:
        return "-" if value is None else f"{value:.4f}"
    lines = ["megaframe-train: sweep summary", f"{'point':>5}  {'exit':>4}  {'step':>6}  {'loss':>8}  {'eval_loss':>9}  overrides"]
    for row in rows:
        lines.append(f"{row['point']:>5}  {row['exit_code']:>4}  {row['step'] if row['step'] is not None else '-':>6}  "
                     f"{number(row['loss']):>8}  {number(row['eval_loss']):>9}  {' '.join(row['overrides'])}")
    return "\n".join(lines)
