"""Registers the typed schema and the recipes with Hydra."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from megaframe.config.schema import TrainConfig
from megaframe.common.paths import recipes_dir

SCHEMA_NAME = "megaframe_schema"


def register_configs(overrides: Optional[Sequence[str]] = None) -> None:
    """Store TrainConfig as the schema conf/config.yaml lists first, and recipes as group `recipe`:
    those the overrides name (`recipe=NAME`), or every one when `overrides` is None or names one
    that is not a file (so that Hydra's "no such option" lists them all).

    Recipes live at the top of the repo (not under conf/) so users find them; registering them here
    makes `recipe=NAME` work from a checkout and from an installed wheel alike. Each is parsed once
    per process, and only when asked for: parsing all twelve was about 0.1 s of every start.
    """
    _register_schema()
    available = recipe_files()
    wanted = _named_recipes(overrides) if overrides is not None else None
    if wanted is None or not wanted <= available.keys():
        wanted = set(available)
    store = ConfigStore.instance()
    for name in sorted(wanted - _REGISTERED_RECIPES):
        store.store(group="recipe", name=name, node=OmegaConf.load(available[name]), package="_global_")
        _REGISTERED_RECIPES.add(name)


@functools.cache
def recipe_files() -> dict[str, Path]:
    """recipes/*.yaml by name, listed once per process."""
    return {path.stem: path for path in sorted(recipes_dir().glob("*.yaml"))}


_REGISTERED_RECIPES: set[str] = set()  # what this process's ConfigStore holds already


@functools.cache
def _register_schema() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
    register_sweep_launcher()


def unknown_recipe(overrides: Sequence[str]) -> Optional[str]:
    """One line when `recipe=VALUE` names no recipes/NAME.yaml (or a sweep's list holds such a name),
    or None. The group is optional in conf/config.yaml (a run need not use a recipe), and Hydra skips
    an optional group's missing option without a word: `recipe=llama2_7x`, `recipe=` and
    `recipe=path/to/file` trained the default model."""
    available = ", ".join(recipe_files())
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+").split("@", 1)[0] != "recipe" or _SWEEP_FUNCTION.match(value):
            continue  # another key, `~recipe` (none), or a sweep function Hydra expands
        for name in value.split(","):  # a -m sweep's list
            name = name.strip().strip("'\"")  # Hydra's grammar drops quotes and blanks around a value
            if not re.fullmatch(r"[\w-]+", name):
                return (f"recipe={value}: not a recipe name; give the name of a file in recipes/ without "
                        f".yaml: {available}")
            if name not in recipe_files():
                return f"recipe={name}: no such recipe; available: {available}"
    return None


_SWEEP_FUNCTION = re.compile(r"\s*(choice|range|glob|interval|shuffle|sort|tag)\(")


def _named_recipes(overrides: Sequence[str]) -> Optional[set[str]]:
    """The recipe names `recipe=NAME` overrides give; None (all) for a sweep or another expression."""
    names = set()
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.split("@", 1)[0] == "recipe":
            if not re.fullmatch(r"[\w.-]+", value):
                return None
            names.add(value)
    return names


def register_sweep_launcher() -> None:
    """The `-m` launcher (hydra/launcher=megaframe_local, which conf/config.yaml selects): importing it
    stores its config. Hydra finds plugins by scanning the hydra_plugins package, which an editable
    install's import hook hides from it, so the class is registered by hand (a no-op when found)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.megaframe_launcher.local_launcher import MegaframeLocalLauncher

    Plugins.instance().register(MegaframeLocalLauncher)
