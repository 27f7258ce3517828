"""The compatibility table: docs/parallelism.md shows what the rules say, and every refusal names the keys and
offers alternatives that the same rules accept."""
from __future__ import annotations

import re

import pytest

from tests.support.helpers import REPO
from megaframe.backends.deepspeed.compat import (Combination, combinations, markdown, refusal, refused_combinations,
                                                 with_table)
from megaframe.backends.deepspeed.rules import config_problem
from megaframe.config.validate import ConfigError, validate

REFUSED = refused_combinations()


def test_the_guides_table_is_what_the_rules_say():
    guide = (REPO / "docs" / "parallelism.md").read_text()
    assert with_table(guide) == guide, "docs/parallelism.md's table is stale: run python tools/compat_table.py --write"


def test_table_covers_every_combination_once():
    assert len(combinations()) == 4 * 9 * 3 * 3
    assert "| stage3 | nvme | nvme | yes | yes | no" in markdown()


def test_known_deepspeed_limits_are_refused_and_the_rest_accepted():
    """Facts measured against DeepSpeed 0.19 (shared REFERENCE.md): the rules must encode them."""
    def ok(stage, optimizer, param, layout="dp=2", dtype="fp32"):
        return refusal(Combination(stage, optimizer, param, dtype, layout)) is None
    assert not ok(2, "none", "none", "pp=2 × dp=2") and ok(1, "cpu", "none", "pp=2 × dp=2")  # pipeline: ZeRO <= 1
    assert not ok(2, "none", "cpu") and ok(3, "none", "cpu")  # parameter offload needs ZeRO-3
    assert not ok(2, "nvme", "none") and ok(3, "nvme", "none")  # nvme below stage 3 silently becomes cpu
    assert not ok(0, "cpu", "none") and ok(1, "cpu", "none")
    assert ok(3, "cpu", "cpu", "tp=2 × dp=2", "bf16") and ok(3, "nvme", "nvme", "tp=2 × dp=2", "fp16")


def _apply(combo: Combination, alternative: str):
    cfg = combo.config()
    for token in alternative.split():
        key, value = token.split("=")
        if key == "zero":
            cfg.zero.stage = int(value.removeprefix("stage"))
        else:
            setattr(cfg.offload, key.removeprefix("offload."), value)
    return cfg


@pytest.mark.parametrize("combo,message", REFUSED, ids=[" ".join(c.overrides()) for c, _ in REFUSED])
def test_every_refusal_is_one_line_naming_the_keys_with_legal_alternatives(combo, message):
    assert "\n" not in message and len(message) < 300
    problem, sep, fixes = message.rpartition("; use ")
    assert sep and problem, f"no alternative offered: {message}"
    named = re.findall(r"(zero\.stage|offload\.optimizer|offload\.param|parallel\.pp)=", problem)
    assert named, message
    for key in named:  # each key the problem names holds the value it says
        value = {"zero.stage": combo.stage, "offload.optimizer": combo.optimizer, "offload.param": combo.param,
                 "parallel.pp": combo.config().parallel.pp}[key]
        assert f"{key}={value}" in problem, message
    alternatives = re.split(r", | or ", fixes)
    assert 1 <= len(alternatives) <= 2
    for alternative in alternatives:
        try:
            validate(_apply(combo, alternative), combo.world_size, lambda: True, engine_problem=config_problem)
        except ConfigError as err:
            pytest.fail(f"{message!r} suggests {alternative!r}, which is refused too: {err}")
