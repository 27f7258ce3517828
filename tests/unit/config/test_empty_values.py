"""Empty values are refused before launch (issue 50, Build 3), as a class read off the schema: every
string key of TrainConfig, empty or blank, and every string entry of a list key; the list keys whose
empty list falls back to something else; an empty run or sweep directory. Each was accepted, and
meant something else: `data.blend=[]` trained on the demo corpus, `data.tokenizer=` and `train.resume=`
resolved to the current directory, `hydra.run.dir=` trained and checkpointed there.

Values are set on one composed config (as test_hostile_values.py does: composing costs 0.36 CPU-s a
call); the command-line cases go through megaframe-train's and megaframe-plan's main in-process."""
from __future__ import annotations

import copy
import dataclasses
import typing

import pytest

from megaframe.backends.registry import engine
from megaframe.launch.main import train_main
from megaframe.config.compose import compose
from megaframe.config.empty_values import EMPTY_LIST_KEYS, empty_value_problem
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError, requested_world_size, validate
from megaframe.plan.cli import main as plan_main


def _leaves(cls, prefix: str = ""):
    """(dotted key, type) of every field, Optional[...] unwrapped, nested dataclasses walked."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if typing.get_origin(kind) is typing.Union:
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        if dataclasses.is_dataclass(kind):
            yield from _leaves(kind, f"{prefix}{field.name}.")
        else:
            yield prefix + field.name, kind


LEAVES = list(_leaves(TrainConfig))
STRING_KEYS = [key for key, kind in LEAVES if kind is str]
LIST_KEYS = [key for key, kind in LEAVES if typing.get_origin(kind) is list or kind is list]
BLANKS = ["", "  ", "\t"]


def test_the_class_covers_every_string_and_list_key():
    """The schema's string keys (paths, names, choices) and list keys all reach the rule below."""
    assert len(STRING_KEYS) >= 35, STRING_KEYS
    assert {"data.path", "data.valid_path", "data.tokenizer", "data.cache_dir", "train.resume",
            "offload.nvme_path", "train.fast_save_dir", "logging.wandb.project"} <= set(STRING_KEYS)
    assert {"data.blend", "data.valid_blend", "plan.engines", "launcher.sbatch_extra"} <= set(LIST_KEYS)


@pytest.fixture(scope="module")
def default_config():
    return compose([])[0]


def _with(cfg, key: str, value):
    cfg = copy.deepcopy(cfg)
    *path, name = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, name, value)
    return cfg


def _refused(cfg) -> str:
    with pytest.raises(ConfigError) as refused:
        validate(cfg, requested_world_size(cfg), lambda: False, lambda: True, engine().config_problem)
    return str(refused.value)


@pytest.mark.parametrize("key", STRING_KEYS)
def test_an_empty_or_blank_string_key_is_one_line_naming_it(key, default_config):
    for blank in BLANKS:
        message = _refused(_with(default_config, key, blank))
        assert "\n" not in message and message.startswith(f"{key}={blank!r} is empty"), (blank, message)


@pytest.mark.parametrize("key", LIST_KEYS)
def test_a_blank_entry_of_a_list_key_is_one_line_naming_it(key, default_config):
    message = _refused(_with(default_config, key, ["x", " "] if key != "data.blend" else [1.0, " "]))
    assert "\n" not in message and message.startswith(f"{key} entry 2 is empty"), message


@pytest.mark.parametrize("key", LIST_KEYS)
def test_an_empty_list_is_refused_only_where_it_means_something_else(key, default_config):
    """data.blend=[] and data.valid_blend=[] fall back (demo corpus, held-out part); plan.engines=[]
    and launcher.sbatch_extra=[] say "none" and mean it."""
    cfg = _with(default_config, key, [])
    if key in EMPTY_LIST_KEYS:
        assert empty_value_problem(cfg).startswith(f"{key}=[] is empty"), empty_value_problem(cfg)
    else:
        assert empty_value_problem(cfg) is None


EMPTY_OVERRIDES = ["data.blend=[]", "data.valid_blend=[]", "hydra.run.dir=", "hydra.run.dir=' '", "data.path=",
                   "data.tokenizer=", "data.tokenizer=' '", "train.resume=", "data.cache_dir=",
                   "offload.nvme_path=", "data.blend=[1.0,'']", "data.valid_path=", "launcher.ray_address="]


@pytest.mark.parametrize("override", EMPTY_OVERRIDES)
def test_megaframe_train_refuses_an_empty_value_before_launch(override, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty run dir or tokenizer would have been this directory
    with pytest.raises(SystemExit) as ended:
        train_main([override, "train.max_steps=1"])
    lines = capsys.readouterr().err.strip().splitlines()
    key = override.split("=", 1)[0]
    assert ended.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megaframe-train: error: {key}") and "empty" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written where it would have run


def test_a_sweep_with_an_empty_sweep_dir_is_refused(capsys, tmp_path, monkeypatch):
    """-m goes through hydra.main, which never composes before launching: the override is read as given."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        train_main(["-m", "hydra.sweep.dir=", "train.seed=1,2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and "hydra.sweep.dir='' is empty" in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_megaframe_plan_refuses_an_empty_blend(capsys):
    with pytest.raises(SystemExit) as ended:
        plan_main(["data.blend=[]"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and lines[0].startswith("megaframe-plan: error: data.blend=[]")
