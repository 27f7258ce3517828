"""backend=NAME picks the engine (backends/registry.py); a name megaframe has no engine for is one
line and exit 2 before launch, whichever way it is spelled."""
from __future__ import annotations

import pytest

from megaframe.backends.registry import ENGINES, engine, validate_for_engine
from megaframe.launch.checks import check
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError


def _refusal(overrides: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ended:
        check(overrides)
    assert ended.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_deepspeed_is_the_default_engine():
    cfg, layout, _ = check([])
    assert cfg.backend.name == "deepspeed" and engine(cfg.backend.name).name == "deepspeed"
    assert sorted(ENGINES) == ["deepspeed", "fsdp2"]


def test_an_unknown_backend_group_option_is_one_line(capsys):
    assert _refusal(["backend=fsdp3"], capsys) == "megaframe-train: error: backend=fsdp3: no such option; available: deepspeed, fsdp2"


def test_an_unknown_backend_name_is_one_line_naming_the_key(capsys):
    assert _refusal(["backend.name=fsdp3"], capsys) == (
        "megaframe-train: error: backend.name='fsdp3' is not an engine megaframe has; choose backend=deepspeed or backend=fsdp2")


def test_validation_takes_the_configured_engines_rules():
    cfg = TrainConfig()
    cfg.zero.stage, cfg.offload.param = 1, "cpu"  # DeepSpeed's rule: parameter offload needs ZeRO-3
    with pytest.raises(ConfigError, match=r"offload.param=cpu needs zero=stage3"):
        validate_for_engine(cfg, 1, ask_bf16=False)
    cfg.backend.name = "fsdp3"
    with pytest.raises(ConfigError, match=r"backend.name='fsdp3'"):
        validate_for_engine(cfg, 1)
