"""The bad-input corpus, generated from the schema: every int and float key of TrainConfig, given
values no run can use (a negative; nan and inf for a float), is refused before launch with one line
naming the key; and per config section, a value of the wrong type for an int, a float and a bool
key goes through megaframe-train's whole pre-launch check (compose, then validate: exit code 2).

Range values are set on one composed config rather than composed one by one: Hydra's composition
costs 0.36 CPU-s a call, 100 s for the corpus, and parsing "-1" or "nan" is not what is tested.

Found by this corpus when it was written (2026-11-26), each accepted until then: nan and inf in any
float key without a finite check (plan.mfu, model.moe.*, precision.min_loss_scale, the Ray
launcher's CPUs, GPUs and connect timeout, train.spike.threshold=inf), negative MoE and fp16
loss-scale settings while MoE or fp16 was off, launcher.cpus_per_task=-1, and parallel.ep=-1,
which ended in a ValueError traceback. The hand-written cases that need files, a launcher or the
environment go through the real command in tests/e2e/test_cli_errors.py.
"""
from __future__ import annotations

import copy
import dataclasses
import typing

import pytest

from megaframe.backends.registry import engine
from megaframe.launch.checks import check
from megaframe.config.compose import compose
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError, requested_world_size, validate

OUT_OF_RANGE = {int: [-1], float: [float("nan"), float("inf"), -1.0]}
WRONG_TYPE = {int: "abc", float: "abc", bool: "maybe"}


def _leaves(cls, prefix: str = ""):
    """(dotted key, type) of every scalar field, Optional[...] unwrapped."""
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
RANGE_CASES = [(key, value) for key, kind in LEAVES for value in OUT_OF_RANGE.get(kind, [])]
# the first int, float and bool key of each section: Hydra's type check is the same for all
TYPE_CASES = list({(key.split(".")[0], kind): f"{key}={WRONG_TYPE[kind]}"
                   for key, kind in reversed(LEAVES) if kind in WRONG_TYPE}.values())


def test_the_corpus_covers_the_schema():
    """At least 150 cases (issue 31), and every numeric section of the config is in it."""
    assert len(RANGE_CASES) + len(TYPE_CASES) >= 150, (len(RANGE_CASES), len(TYPE_CASES))
    sections = {key.split(".")[0] for key, _ in RANGE_CASES}
    assert {"model", "parallel", "optim", "train", "precision", "zero", "launcher", "plan"} <= sections, sections


@pytest.fixture(scope="module")
def default_config():
    return compose([])[0]


def _with(cfg, key: str, value):
    """A copy of cfg with the dotted key set to value."""
    cfg = copy.deepcopy(cfg)
    *path, name = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, name, value)
    return cfg


@pytest.mark.parametrize("key,value", RANGE_CASES, ids=[f"{k}={v}" for k, v in RANGE_CASES])
def test_an_out_of_range_value_is_one_line_naming_the_key(key, value, default_config):
    cfg = _with(default_config, key, value)
    with pytest.raises(ConfigError) as refused:  # not a ValueError of the grid, a traceback after launch
        validate(cfg, requested_world_size(cfg), lambda: False, lambda: True, engine().config_problem)
    message = str(refused.value)
    assert "\n" not in message and key in message, message


@pytest.mark.parametrize("override", TYPE_CASES)
def test_a_value_of_the_wrong_type_ends_the_command_with_exit_2(override, capsys):
    with pytest.raises(SystemExit) as ended:
        check([override])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("megaframe-train: error: "), lines
    assert override.split("=")[0] in lines[0], lines[0]
    key = override.split("=")[0]
    assert f"; {key} takes " in lines[0], lines[0]  # the fix: what the key takes


def test_a_whole_number_in_exponent_notation_gets_the_value_to_write(capsys):
    """Hydra reads 1e9 as a float, which an int key refuses: the line gives the integer to write."""
    with pytest.raises(SystemExit) as ended:
        check(["optim=muon", "optim.muon.exchange_bucket_size=1e9"])
    line = capsys.readouterr().err.strip()
    assert ended.value.code == 2
    assert line.endswith("; write it as a whole number: optim.muon.exchange_bucket_size=1000000000"), line
