"""Registers the typed schema and the recipes with Hydra."""
from __future__ import annotations

import functools

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from megaframe.config.schema import TrainConfig
from megaframe.paths import recipes_dir

SCHEMA_NAME = "megaframe_schema"


@functools.cache
def register_configs() -> None:
    """Store TrainConfig as the schema conf/config.yaml lists first, and recipes/*.yaml as group `recipe`.

    Recipes live at the top of the repo (not under conf/) so users find them; registering them here
    makes `recipe=NAME` work from a checkout and from an installed wheel alike. Once per process: the
    store outlives every composition, and parsing the recipes again cost each rank a fraction of a second.
    """
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=TrainConfig)
    register_sweep_launcher()
    for path in sorted(recipes_dir().glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def register_sweep_launcher() -> None:
    """The `-m` launcher (hydra/launcher=megaframe_local, which conf/config.yaml selects): importing it
    stores its config. Hydra finds plugins by scanning the hydra_plugins package, which an editable
    install's import hook hides from it, so the class is registered by hand (a no-op when found)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.megaframe_launcher.local_launcher import MegaframeLocalLauncher

    Plugins.instance().register(MegaframeLocalLauncher)
