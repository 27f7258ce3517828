"""Recipes are registered with Hydra when a composition names them (config/store.py)."""
from __future__ import annotations

import subprocess
import sys

from tests.support.helpers import REPO, cli_env

_PROBE = """
from hydra.core.config_store import ConfigStore
from megaframe.config.compose import compose

cfg, _ = compose(["model.num_layers=2"])
print(sorted(ConfigStore.instance().repo.get("recipe", {})))
cfg, _ = compose(["recipe=llama2_7b", "cluster=h100_80g"])
print(sorted(ConfigStore.instance().repo.get("recipe", {})), cfg.model.num_layers)
"""


def test_only_the_recipes_a_composition_names_are_parsed():
    """Parsing all twelve recipe files was about 0.1 s of every start (issue 35)."""
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "['llama2_7b.yaml'] 32"]
