"""Finds conf/ and recipes/ for a source checkout, an editable install and a wheel alike."""
from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # megaframe/, above common/


def _first_existing(*candidates: Path) -> Path:
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(f"none of {[str(p) for p in candidates]} exists; reinstall megaframe")


def conf_dir() -> Path:
    """The Hydra config directory: the repo's conf/ when run from a checkout, else the packaged copy."""
    override = os.environ.get("MEGAFRAME_CONF_DIR")
    if override:
        return Path(override).resolve()
    return _first_existing(_PACKAGE_DIR.parent / "conf", _PACKAGE_DIR / "_conf")


def recipes_dir() -> Path:
    """The recipes directory, found the same way as conf_dir()."""
    return _first_existing(_PACKAGE_DIR.parent / "recipes", _PACKAGE_DIR / "_recipes")


def cache_dir(configured: str | None = None) -> Path:
    """Where derived data (the demo corpus) is cached: data.cache_dir, $XDG_CACHE_HOME or ~/.cache."""
    if configured:
        return Path(configured).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megaframe"


def nearest_existing(path: Path) -> Path:
    """`path`, or its closest ancestor that exists (where a folder to be made would live)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
