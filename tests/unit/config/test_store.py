"""Recipes are registered with Hydra when a composition names them (config/store.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megaframe.config.store import unknown_recipe
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


@pytest.mark.parametrize("value", ["", " ", "/etc/passwd", "../conf/config", "llama2_7b/../gpt_1t", "llama2_7b.yaml"])
def test_a_recipe_value_that_is_no_name_is_refused(value):
    """Hydra skips the optional group's value that names no option: each of these planned (and
    trained) the default model with exit 0 (found by review)."""
    problem = unknown_recipe([f"recipe={value}"])
    assert problem is not None and problem.startswith(f"recipe={value}: not a recipe name; give the name of a file "
                                                      f"in recipes/ without .yaml: gpt3_175b, gpt_1t,")


@pytest.mark.parametrize("overrides, problem", [
    (["recipe=llama2_7b"], None), (["recipe='llama2_7b'"], None), (["~recipe"], None),
    (["recipe=glob(llama2_*)"], None), (["recipe=llama2_7b,llama3_8b"], None),
    (["recipe=llama2_7b,llama2_7x"], "recipe=llama2_7x: no such recipe"),
    (["+recipe@x=nope"], "recipe=nope: no such recipe")])
def test_recipe_names_and_sweeps_pass_and_a_missing_name_is_named(overrides, problem):
    found = unknown_recipe(overrides)
    assert found == problem if problem is None else found.startswith(problem)
