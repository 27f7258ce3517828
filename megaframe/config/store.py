"""Registers the typed schema with Hydra so YAML groups merge into dataclasses."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from megaframe.config.schema import TrainConfig

SCHEMA_NAME = "megaframe_schema"


def register_configs() -> None:
    """Store TrainConfig as the schema that conf/config.yaml lists first in its defaults."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
