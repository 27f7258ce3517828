"""DeepSpeed's own config rules (backends/deepspeed/rules.py), handed to validation as the CLI and the
planner hand them: refused there with one line naming the key, accepted by validation without them."""
from __future__ import annotations

import pytest

from megaframe.backends.deepspeed.rules import config_problem, config_warnings, layout_free_unsupported
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError, validate, warnings


def _never_fp16() -> bool:
    return False


@pytest.mark.parametrize("group,key,value,fragment", [
    ("zero", "reduce_bucket_size", 0, "zero.reduce_bucket_size=0 must be >= 1"),
    ("zero", "stage3_param_persistence_threshold", -1, "zero.stage3_param_persistence_threshold=-1 must be >= 0"),
    ("offload", "param_buffer_size", 0, "offload.param_buffer_size=0 must be >= 1"),
    ("offload", "aio_queue_depth", 0, "offload.aio_queue_depth=0 must be >= 1"),
])
def test_zero_and_offload_knobs_are_deepspeeds_rules(group, key, value, fragment):
    cfg = TrainConfig()
    setattr(getattr(cfg, group), key, value)
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        validate(cfg, 1, _never_fp16, engine_problem=config_problem)
    assert validate(cfg, 1, _never_fp16).world_size == 1  # not validation's own rule: another engine may differ


def test_a_combination_deepspeed_cannot_run_is_refused_only_with_its_rules():
    cfg = TrainConfig()
    cfg.zero.stage, cfg.offload.param = 1, "cpu"
    with pytest.raises(ConfigError, match=r"offload.param=cpu needs zero=stage3 \(zero.stage=1\); use zero=stage3"):
        validate(cfg, 1, _never_fp16, engine_problem=config_problem)
    validate(cfg, 1, _never_fp16)


def test_nvme_with_stage3_needs_a_path(tmp_path):
    cfg = TrainConfig()
    cfg.zero.stage = 3
    cfg.offload.optimizer = cfg.offload.param = "nvme"
    with pytest.raises(ConfigError, match=r"offload=nvme needs offload.nvme_path=/a/fast/local/dir"):
        validate(cfg, 1, _never_fp16, engine_problem=config_problem)
    cfg.offload.nvme_path = str(tmp_path)
    validate(cfg, 1, _never_fp16, engine_problem=config_problem)


def test_deepspeeds_pipeline_takes_zero_0_or_1_only():
    cfg = TrainConfig()  # 2 layers
    cfg.parallel.pp, cfg.zero.stage = 2, 1
    assert validate(cfg, 2, _never_fp16, engine_problem=config_problem).pp == 2
    cfg.zero.stage = 2
    with pytest.raises(ConfigError, match="DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; use zero=stage1"):
        validate(cfg, 2, _never_fp16, engine_problem=config_problem)


def test_mixed_precision_at_zero0_warns_that_checkpoints_stay_in_their_layout():
    cfg = TrainConfig()
    cfg.precision.dtype = "bf16"
    layout = validate(cfg, 1, _never_fp16, engine_problem=config_problem)
    assert layout_free_unsupported(cfg, layout)
    found = warnings(cfg, layout, config_warnings)
    assert any("resume works in this layout only, with train.trust_pickled_checkpoint=true" in w
               and "use zero=stage1" in w for w in found)
    assert not warnings(cfg, layout)  # the engine's warnings come only with the engine
    cfg.zero.stage = 1
    layout = validate(cfg, 1, _never_fp16, engine_problem=config_problem)
    assert not layout_free_unsupported(cfg, layout)
    assert not warnings(cfg, layout, config_warnings)


def test_engine_only_checkpoints_warn_that_resuming_them_needs_trust():
    cfg = TrainConfig()
    cfg.train.universal_checkpoint = False
    layout = validate(cfg, 1, _never_fp16, engine_problem=config_problem)
    assert any("train.trust_pickled_checkpoint=true" in w for w in warnings(cfg, layout, config_warnings))
    cfg.train.trust_pickled_checkpoint = True
    assert not warnings(cfg, layout, config_warnings)
