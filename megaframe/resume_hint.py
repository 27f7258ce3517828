"""How to pick a run up again: the command a stopped or failed run's closing line prints, and
`train.resume=latest-run`, which finds the newest run of Hydra's dated default directory.

A run Hydra names by date and time (outputs/DATE/TIME) cannot be resumed by running the same
command again: that command gets a new directory. So the closing line names the run directory
(`hydra.run.dir=...`) in the exact command that resumes it, and `train.resume=latest-run` resumes
the newest run under the default output root that has a checkpoint.

The command is the one the user typed: megaframe-train remembers its arguments in the environment
(remember_command) before it launches, so that the ranks it starts, which print the closing line,
know them. A rank started by another launcher (torchrun, srun, Ray) does not know that launcher's
command line and says which part to change instead.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Callable, Optional, Sequence

ARGS_ENV = "MEGAFRAME_COMMAND_ARGS"  # the user's megaframe-train arguments, JSON, for the ranks it starts
LATEST_RUN = "latest-run"
# what a resume must not repeat: the run dir is named anew, train.resume=auto is the default, and an
# exit_at_step already reached would stop the resumed run at once
_DROPPED = ("hydra.run.dir", "train.resume", "train.exit_at_step")


def remember_command(args: Sequence[str]) -> None:
    """Record megaframe-train's arguments for the closing line of this process and its ranks."""
    os.environ[ARGS_ENV] = json.dumps([str(a) for a in args])


def _key(arg: str) -> str:
    return arg.lstrip("+~").split("=", 1)[0]


def resume_command(run_dir: Path) -> str:
    """The command that resumes the run in run_dir: the remembered arguments, without those a
    resume must not repeat, and with hydra.run.dir naming the run."""
    from megaframe.config.compose import hydra_quoted

    pinned = f"hydra.run.dir={hydra_quoted(str(Path(run_dir).resolve()))}"
    try:
        args = json.loads(os.environ.get(ARGS_ENV, "null"))
    except ValueError:
        args = None
    if not isinstance(args, list):  # a rank of torchrun, srun or Ray: their command line is not ours to see
        return f"run this job's launch command again with {shlex.quote(pinned)}"
    kept = [a for a in args if _key(a) not in _DROPPED]
    return " ".join(["megaframe-train", *map(shlex.quote, kept), shlex.quote(pinned)])




def wants_latest_run(args: Sequence[str]) -> bool:
    return any(_key(a) == "train.resume" and a.split("=", 1)[1] == LATEST_RUN for a in args if "=" in a)


def latest_run(args: list[str]) -> list[str]:
    """megaframe-train's arguments with train.resume=latest-run resolved (resolve_latest_run), said in
    one line; other arguments unchanged. ConfigError (one line) when no run has a checkpoint."""
    if not wants_latest_run(args):
        return args
    from megaframe.config.validate import UNRESOLVED, ConfigError

    if os.environ.get("WORLD_SIZE"):  # a rank of another launcher: its peers would each pick a run
        raise ConfigError(UNRESOLVED)
    from omegaconf import OmegaConf

    from megaframe.config.compose import compose_for_run

    def pattern(overrides: list[str]) -> str:
        composed = compose_for_run(overrides)[2]
        return str(OmegaConf.to_container(composed.hydra.run, resolve=False)["dir"])

    try:
        args, run_dir = resolve_latest_run(args, pattern)
    except ValueError as err:  # ConfigError from the composition too: one line either way
        raise ConfigError(str(err)) from None
    print(f"megaframe-train: train.resume={LATEST_RUN}: resuming {run_dir}", flush=True)
    return args


def resolve_latest_run(args: list[str], run_dir_pattern: Callable[[list[str]], str]) -> tuple[list[str], str]:
    """For train.resume=latest-run: (the arguments with train.resume=auto and hydra.run.dir naming
    the newest run under the default output root that has a checkpoint, that run dir). With
    hydra.run.dir given, that run is the one. `run_dir_pattern(args)` gives hydra.run.dir unresolved
    (`outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}`). Raises ValueError (one line) when no run qualifies."""
    rest = [a for a in args if _key(a) != "train.resume"] + ["train.resume=auto"]
    pinned = [a.split("=", 1)[1] for a in args if _key(a) == "hydra.run.dir"]
    if pinned:
        return rest, _checkpointed(pinned[-1], "hydra.run.dir")
    pattern = run_dir_pattern(rest)
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if "${" in part), len(parts))
    if fixed == len(parts):
        return rest, _checkpointed(pattern, "the run dir")  # a fixed default run dir: it is the newest run
    root = Path(*parts[:fixed]) if fixed else Path(".")
    newest = newest_run(root, len(parts) - fixed)
    if newest is None:
        raise ValueError(f"train.resume={LATEST_RUN}: no run under {root}/ has a checkpoint (looked for "
                         f"{root}/{'/'.join(['*'] * (len(parts) - fixed))}/checkpoints/latest); name the run to "
                         f"resume with hydra.run.dir=DIR")
    return [*rest, f"hydra.run.dir={_quoted(str(newest))}"], str(newest)


def _checkpointed(run_dir: str, named_by: str) -> str:
    """run_dir, when it holds a checkpoint to resume; ValueError otherwise: latest-run asks to resume,
    and such a run dir started a fresh run after "resuming DIR" was said."""
    from megaframe.config.compose import override_value

    try:  # the path the override names: hydra_quoted('runs/my run') is what resume commands print
        path = override_value(f"hydra.run.dir={run_dir}")
    except Exception:  # noqa: BLE001 - Hydra's grammar errors are its own classes; the run reports them
        path = run_dir
    if "${" not in path and not (Path(path) / "checkpoints" / "latest").is_file():
        raise ValueError(f"train.resume={LATEST_RUN}: {named_by} {run_dir} has no checkpoint to resume (no "
                         f"checkpoints/latest); leave train.resume out to start a run there, or name a run that "
                         f"has one")
    return run_dir


def _quoted(path: str) -> str:
    from megaframe.config.compose import hydra_quoted

    return hydra_quoted(path)


def newest_run(root: Path, depth: int) -> Optional[Path]:
    """The run dir `depth` levels under root whose checkpoints/latest was written last, or None.
    Links are not followed: a run dir or `latest` that is a symlink is not one megaframe made."""
    best: Optional[tuple[int, Path]] = None
    if depth < 1 or not root.is_dir():
        return None
    for candidate in root.glob("/".join(["*"] * depth)):
        if any(p.is_symlink() for p in (candidate, *candidate.parents[:depth - 1])) or not candidate.is_dir():
            continue
        latest = candidate / "checkpoints" / "latest"
        if latest.is_symlink() or not latest.is_file():
            continue
        stamp = latest.stat().st_mtime_ns
        if best is None or (stamp, str(candidate)) > (best[0], str(best[1])):
            best = (stamp, candidate)
    return None if best is None else best[1].resolve()
