"""Weights & Biases: offline by default (never waits on a network), resumes the same run id, and goes
offline when online cannot start."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

from megaframe.config.schema import WandbConfig
from megaframe.common.atomic_io import atomic_write_text


# what wandb's Settings accept in WANDB_MODE (tests/unit/tracking/test_wandb_key.py reads them from wandb)
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


def wandb_mode(mode: Optional[str], environ=os.environ) -> str:
    """The mode a run logs in: logging.wandb.mode when set, else WANDB_MODE as W&B itself reads it
    (a user's `WANDB_MODE=disabled` turns it off, as in every W&B integration), else offline."""
    if mode is not None:
        return mode
    value = environ.get("WANDB_MODE")
    return {"disabled": "disabled", "online": "online", "run": "online", "shared": "online"}.get(value, "offline")


def env_mode_problem(mode: str, environ=os.environ, configured: bool = True) -> Optional[str]:
    """wandb reads WANDB_MODE from the environment as it loads its settings, whatever mode megaframe
    passes (logging.wandb.mode decides), and refuses a value it does not know: rank 0 ended after
    launch with its ValidationError. One line before launch instead; nothing when W&B is disabled
    (wandb is never imported then). configured: logging.wandb.mode was set (else the line names no
    setting the user did not make)."""
    value = environ.get("WANDB_MODE")
    if mode == "disabled" or value is None or value in WANDB_MODES:
        return None
    unset = f"unset it (logging.wandb.mode={mode} chooses the mode)" if configured else \
        "unset it (runs log offline then, or as logging.wandb.mode says)"
    return (f"WANDB_MODE={value!r} (in the environment) is no W&B mode, and wandb refuses to start with it; {unset} "
            f"or set it to one of {', '.join(WANDB_MODES)}")


def project_problem(project: Optional[str], mode: str, environ=os.environ) -> Optional[str]:
    """A project name W&B refuses (its Settings' rule: at most 128 characters, none of / \\ # ? % :)
    ended rank 0 after launch with exit 1, the code of a bug: logging.wandb.project's, and
    WANDB_PROJECT's, which wandb reads and checks as it loads its settings whatever megaframe passes.
    Nothing when W&B is disabled."""
    if mode == "disabled":
        return None
    for named, value in (("logging.wandb.project", project), ("WANDB_PROJECT", environ.get("WANDB_PROJECT"))):
        found = sorted({char for char in "/\\#?%:" if char in (value or "")})
        if value is not None and (len(value) > 128 or found):
            why = f"holds {' '.join(found)}" if found else f"has {len(value)} characters"
            where = " (in the environment)" if named == "WANDB_PROJECT" else ""
            return (f"{named}={value!r}{where}: W&B refuses a project name that {why} (none of / \\ # ? % :, at "
                    f"most 128 characters); choose another, e.g. {named}=my-project")
    return None


_CHECKED_APART = {"WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"}  # env_mode_problem, online_key_problem, project


def env_settings_problem(mode: str, environ=os.environ) -> Optional[str]:
    """A WANDB_* variable W&B's settings refuse (WANDB_INIT_TIMEOUT=abc, WANDB_SILENT=maybe,
    WANDB_RUN_ID=a/b): wandb reads them as it starts, and rank 0 ended after launch with exit 1 and
    "ValidationError: 1 validation error for Settings", naming no variable. Each is read here by
    wandb's own Settings, one at a time, so the line names it; wandb is imported (0.5 s) only when
    such a variable is set, and not at all with W&B disabled."""
    variables = sorted(name for name in environ if name.startswith("WANDB_") and name not in _CHECKED_APART)
    if mode == "disabled" or not variables:
        return None
    from wandb.sdk.wandb_settings import Settings

    if not hasattr(Settings, "update_from_env_vars"):  # a wandb without it (before 0.19): it checks them itself
        return None
    for name in variables:
        try:
            Settings().update_from_env_vars({name: environ[name]})
        except Exception as err:  # pydantic's ValidationError, wandb's UsageError
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            why = next((line.split(" [type=")[0] for line in lines if " [type=" in line),  # pydantic's reason
                       lines[0] if lines else type(err).__name__)
            return (f"{name}={environ[name]!r} (in the environment): W&B refuses it ({why[:200]}); fix or unset it, or "
                    f"set logging.wandb.mode=disabled")
    return None


def online_key_problem(mode: str, environ=os.environ, named: Optional[str] = None) -> Optional[str]:
    """logging.wandb.mode=online needs a W&B key, which wandb otherwise asks for on the terminal of
    every rank 0 (or fails with its own traceback): one line before launch instead. wandb finds a key
    in WANDB_API_KEY, an identity-token file, or the netrc entry `wandb login` writes."""
    if mode != "online" or environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    import netrc
    from urllib.parse import urlparse

    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        path = environ.get("NETRC") or str(Path(environ.get("HOME", "~")).expanduser() / ".netrc")
        if netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"{named or 'logging.wandb.mode=online'} but no W&B key for {host}: set WANDB_API_KEY (or run "
            f"`wandb login`), or log offline (logging.wandb.mode=offline) and `wandb sync` the run later")


class WandbRun:
    """A thin holder for one wandb run (or nothing, when disabled)."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any],
                 default_name: Optional[str] = None, default_group: Optional[str] = None):
        self.run = None
        mode = wandb_mode(cfg.mode)
        if mode == "disabled":
            return
        # offline must never touch the network, and wandb's own files belong in the run dir
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_DIR", str(run_dir))
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        if not id_file.exists():
            atomic_write_text(id_file, run_id + "\n")
        start = lambda mode: wandb.init(  # noqa: E731
            project=cfg.project, entity=cfg.entity, name=cfg.name or default_name, group=cfg.group or default_group,
            mode=mode, dir=str(run_dir), config=config, id=run_id, resume="allow",
            settings=wandb.Settings(console="off"))
        try:
            self.run = start(mode)
        except wandb.errors.Error as err:
            if mode != "online":
                raise
            # W&B unreachable (an outage, compute nodes without egress) or the key refused: the run
            # goes on, its records kept for `wandb sync`, rather than a job of many nodes ending at
            # step 0 after wandb's init_timeout (90 s) on every start
            reason = " ".join(str(err).split())[:200]
            print(f"megaframe: warning: W&B did not start online ({type(err).__name__}: {reason}): logging offline "
                  f"in {run_dir / 'wandb'} instead; upload it later with `wandb sync`", file=sys.stderr, flush=True)
            wandb.teardown()  # wandb's service still holds the run id the failed start registered
            self.run = start("offline")

    def sync_hint(self) -> Optional[str]:
        """How to upload an offline run (None when online or disabled)."""
        if self.run is None or self.run.settings.mode != "offline":
            return None
        return f"wandb sync {Path(self.run.dir).parent}"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; a non-zero exit_code marks it failed in W&B (a restart resumes it)."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
