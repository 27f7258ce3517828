"""The zero / offload / precision groups reach DeepSpeed: every knob parsed by DeepSpeed's own config
classes (which reject unknown keys), with the value the user set."""
from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from megaframe.backends.deepspeed.ds_config import to_ds_config
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import validate


def _ds(cfg: TrainConfig, swap_dir: str | None = None) -> dict:
    return to_ds_config(cfg, validate(cfg, 1, lambda: True), swap_dir=swap_dir)


def test_zero_knobs_reach_deepspeed():
    cfg = TrainConfig()
    cfg.zero.stage = 3
    cfg.zero.overlap_comm, cfg.zero.contiguous_gradients = True, False
    cfg.zero.reduce_bucket_size, cfg.zero.allgather_bucket_size = 1234567, 2345678
    cfg.zero.stage3_prefetch_bucket_size, cfg.zero.stage3_param_persistence_threshold = 345678, 4567
    cfg.zero.stage3_max_live_parameters = 5678901
    parsed = DeepSpeedZeroConfig(**_ds(cfg)["zero_optimization"])
    assert parsed.stage == 3 and parsed.overlap_comm is True and parsed.contiguous_gradients is False
    assert (parsed.reduce_bucket_size, parsed.allgather_bucket_size) == (1234567, 2345678)
    assert (parsed.prefetch_bucket_size, parsed.param_persistence_threshold) == (345678, 4567)
    assert parsed.max_live_parameters == 5678901
    assert parsed.offload_optimizer is None and parsed.offload_param is None


@pytest.mark.parametrize("setting, device, pinned", [(None, "cuda", True), (None, "cpu", False), (True, "cpu", True),
                                                     (False, "cuda", False)])
def test_cpu_offload_and_pin_memory_reach_deepspeed(setting, device, pinned):
    """offload.pin_memory=null (the default) pins on a GPU: unpinned, every offloaded copy was
    synchronous (DeepSpeed's default and megaframe's was false). An explicit value stands."""
    from megaframe.backends.common import pinned_offload

    cfg = TrainConfig()
    cfg.zero.stage, cfg.offload.optimizer, cfg.offload.param, cfg.offload.pin_memory = 3, "cpu", "cpu", setting
    ds = to_ds_config(cfg, validate(cfg, 1, lambda: True), pin_memory=pinned_offload(setting, torch.device(device)))
    parsed = DeepSpeedZeroConfig(**ds["zero_optimization"])
    assert parsed.offload_optimizer.device == "cpu" and parsed.offload_optimizer.pin_memory is pinned
    assert parsed.offload_param.device == "cpu" and parsed.offload_param.pin_memory is pinned
    assert "torch_adam" not in ds["optimizer"]["params"], "offload must use DeepSpeed's CPU Adam"
    assert "aio" not in ds


def test_nvme_offload_knobs_and_aio_reach_deepspeed(tmp_path):
    cfg = TrainConfig()
    cfg.zero.stage, cfg.offload.optimizer, cfg.offload.param = 3, "nvme", "nvme"
    cfg.offload.nvme_path = str(tmp_path)
    off = cfg.offload
    off.optimizer_buffer_count, off.param_buffer_count, off.param_buffer_size, off.param_max_in_cpu = 6, 7, 8_000_000, 9
    off.aio_block_size, off.aio_queue_depth, off.aio_intra_op_parallelism = 262144, 16, 2
    off.aio_single_submit, off.aio_overlap_events = True, False
    ds = _ds(cfg, swap_dir=str(tmp_path / "mine"))
    parsed = DeepSpeedZeroConfig(**ds["zero_optimization"])
    assert str(parsed.offload_optimizer.nvme_path) == str(tmp_path / "mine")  # the process's own folder
    assert parsed.offload_optimizer.device == "nvme" and parsed.offload_optimizer.buffer_count == 6
    assert parsed.offload_param.device == "nvme" and str(parsed.offload_param.nvme_path) == str(tmp_path / "mine")
    assert (parsed.offload_param.buffer_count, parsed.offload_param.buffer_size, parsed.offload_param.max_in_cpu) == \
        (7, 8_000_000, 9)
    assert get_aio_config(ds) == {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2,
                                  "single_submit": True, "overlap_events": False, "use_gds": False}
    assert set(ds["aio"]) <= set(get_aio_config(ds)), "a key DeepSpeed's aio parser does not read"


def test_nvme_optimizer_alone_is_legal_and_keeps_params_in_memory(tmp_path):
    cfg = TrainConfig()
    cfg.zero.stage, cfg.offload.optimizer, cfg.offload.nvme_path = 3, "nvme", str(tmp_path)
    parsed = DeepSpeedZeroConfig(**_ds(cfg)["zero_optimization"])
    assert parsed.offload_optimizer.device == "nvme" and parsed.offload_param is None


def test_precision_sections():
    cfg = TrainConfig()
    assert "fp16" not in _ds(cfg) and "bf16" not in _ds(cfg)
    cfg.precision.dtype = "bf16"
    assert _ds(cfg)["bf16"] == {"enabled": True} and "fp16" not in _ds(cfg)
    cfg.precision.dtype = "fp16"
    cfg.precision.initial_scale_power, cfg.precision.loss_scale_window = 12, 50
    cfg.precision.hysteresis, cfg.precision.min_loss_scale = 1, 0.5
    assert _ds(cfg)["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50,
                                "hysteresis": 1, "min_loss_scale": 0.5}


def test_optimizer_without_offload_is_torchs_fused_adamw():
    """Without offload, every accelerator's engine gets torch's fused AdamW (no JIT build), built the
    way DeepSpeed builds it."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    params = dict(_ds(TrainConfig())["optimizer"]["params"])
    optimizer_class, extra = DeepSpeedEngine.get_optimizer_configuration(None, params, True)  # pops torch_adam
    optimizer = optimizer_class([torch.nn.Parameter(torch.ones(3))], **params, **extra)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True


def test_muon_is_handed_to_deepspeed_not_named_in_its_config():
    """optim=muon: megaframe's Muon is the client optimizer (backends/deepspeed/muon_zero.py); an
    "optimizer" section would name DeepSpeed's AdamW (or its own Muon) beside it."""
    cfg = TrainConfig()
    assert _ds(cfg)["optimizer"]["type"] == "AdamW"
    cfg.optim.name, cfg.zero.stage = "muon", 1
    ds = _ds(cfg)
    assert "optimizer" not in ds and ds["zero_optimization"]["stage"] == 1 and ds["zero_allow_untested_optimizer"]
