"""What every part of launch/ reads: the launcher's world, this rank, Hydra's flags, the one-line refusal."""
from __future__ import annotations

import os
import sys
from typing import NoReturn, Optional, Sequence

from megaframe.common.failures import PROG

from megaframe.config.compose import HYDRA_FLAGS  # noqa: F401 - launch/ reads them here


def hydra_flag_names(args: Sequence[str]) -> set[str]:
    """The Hydra flags among the arguments, by name (--cfg=job is --cfg)."""
    return {flag.split("=", 1)[0] for flag in hydra_flags(args)}


def hydra_flags(args: Sequence[str]) -> set[str]:
    """The Hydra flags among the arguments."""
    return {a for a in args if a.split("=", 1)[0] in HYDRA_FLAGS}


def launcher_world_size() -> Optional[int]:
    """WORLD_SIZE set by torchrun (or another launcher), None when started plainly."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def rank() -> int:
    """This process's rank under a launcher, 0 otherwise."""
    return int(os.environ.get("RANK", "0"))


def fail(message: str) -> NoReturn:
    """Bad input before launch: one line on stderr, exit code 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def pins_run_dir(args: Sequence[str]) -> bool:
    return any(a.startswith("hydra.run.dir=") for a in args)


SELF_LAUNCHED = "MEGAFRAME_SELF_LAUNCHED"  # set for the ranks launch/local.py's agent starts
