"""Checkpoints and offload on the CUDA-shaped device (tests/support/fakecuda): what a GPU run saves and
resumes goes between host and device in both directions (optimizer state back onto the device,
offloaded state kept on the host), which plain CPU ranks cannot check. Each run: no violation in any
process, and the resumed curve on the plain CPU run's at rtol 1e-5 (fp32)."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.fakecuda.runs import run_on_device
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow


def test_offloaded_zero3_saves_in_the_background_and_resumes_at_zero3_on_the_device(cpu_reference, tmp_path,
                                                                                    deepspeed_ops):
    """Saved by ZeRO-3 with optimizer and parameters offloaded to the host, written on the background
    thread; resumed by ZeRO-3 without offload, whose optimizer state must come back onto the device."""
    first = ["parallel.dp=2", "zero=stage3", "offload=cpu", "offload.param=cpu", "train.async_save=true",
             "train.save_interval=3", "train.exit_at_step=3"]
    deepspeed_ops(first)
    run_on_device(tmp_path, "zero3", first, world=2)
    resumed = run_on_device(tmp_path, "zero3", ["parallel.dp=2", "zero=stage3"], world=2)
    assert_parity(resumed, cpu_reference, "fakecuda offloaded zero3 -> zero3")


def test_deepspeeds_native_checkpoint_of_offloaded_zero2_resumes_on_the_device(cpu_reference, tmp_path, deepspeed_ops):
    """train.universal_checkpoint=false: DeepSpeed's own files, loaded by DeepSpeed, in the same layout."""
    extra = ["zero=stage2", "offload=cpu", "train.universal_checkpoint=false", "train.trust_pickled_checkpoint=true",
             "train.save_interval=3"]
    deepspeed_ops(extra)
    run_on_device(tmp_path, "native", [*extra, "train.exit_at_step=3"])
    assert_parity(run_on_device(tmp_path, "native", extra), cpu_reference, "fakecuda native zero2 offload")


def test_zero0_resumes_on_the_device_and_its_checkpoint_exports_to_hugging_face(cpu_reference, cpu_reference_run,
                                                                                 tmp_path):
    """ZeRO-0 keeps torch's fused AdamW, whose restored state (its step too) must be device tensors; the
    checkpoint the device run wrote exports to the same Hugging Face weights as the CPU run's."""
    from safetensors.torch import load_file

    from megaframe.convert.cli import export_hf

    extra = ["zero=stage0", "train.save_interval=3"]
    run_on_device(tmp_path, "zero0", [*extra, "train.exit_at_step=3"])
    assert_parity(run_on_device(tmp_path, "zero0", extra), cpu_reference, "fakecuda resumed zero0")

    export_hf(tmp_path / "zero0" / "checkpoints", tmp_path / "hf-device")
    export_hf(cpu_reference_run / "checkpoints", tmp_path / "hf-cpu")
    device, cpu = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf-device", "hf-cpu"))
    assert device.keys() == cpu.keys() and len(cpu) > 0
    for name, weight in cpu.items():  # curves equal at 1e-5 leave the weights a few fp32 ulps apart
        torch.testing.assert_close(device[name], weight, rtol=1e-4, atol=1e-6, msg=f"{name}: device export vs CPU's")


def test_the_fast_tier_saves_device_state_to_node_memory_and_restores_it_onto_the_device(cpu_reference, tmp_path):
    """train.fast_save_interval: each rank's part goes from the device to node-local files and a
    buddy's; a restore publishes them and loads them back onto the device. The shared checkpoint
    of step 4 is removed after the first run (as if its node failed before writing it), so the
    resume must come from the parts of step 3."""
    extra = ["parallel.dp=2", "zero=stage1", "train.save_interval=2", "train.fast_save_interval=1",
             f"train.fast_save_dir={tmp_path / 'shm'}"]
    run_on_device(tmp_path, "fast", [*extra, "train.exit_at_step=4"], world=2)
    checkpoints = tmp_path / "fast" / "checkpoints"
    shutil.rmtree(checkpoints / "global_step4")
    (checkpoints / "latest").write_text("global_step2\n")
    resumed = run_on_device(tmp_path, "fast", extra, world=2)
    assert (checkpoints / "global_step3").is_dir()  # published from the parts: shared saves are at even steps
    assert_parity(resumed, cpu_reference, "fakecuda fast tier restore")


def test_fp16_resumes_on_the_device_with_its_loss_scale(tmp_path):
    """precision=fp16 (DeepSpeed's loss scaler, ZeRO-2): a run stopped at step 3 and resumed on the
    device logs the losses and loss scales of the run that never stopped, bit for bit. The scale
    starts at 2^12 and halves on overflows and grows every 2 clean steps, so it moves on both sides
    of the save and only a restored scaler (its scale and its count of clean steps) continues it."""
    extra = ["zero=stage2", "precision=fp16", "precision.initial_scale_power=12", "precision.hysteresis=1",
             "precision.loss_scale_window=2", "train.log_interval=1", "train.save_interval=3"]
    straight = run_on_device(tmp_path, "straight", extra)
    run_on_device(tmp_path, "stopped", [*extra, "train.exit_at_step=3"])
    resumed = run_on_device(tmp_path, "stopped", extra)
    logged = [(r["step"], r["loss"], r["loss_scale"]) for r in straight if "loss" in r]
    assert len(logged) == 6 and len({scale for *_, scale in logged}) > 1, logged  # the scale moved
    # the run folder's metrics.jsonl holds the first run's steps, then the resumed run's
    assert [(r["step"], r["loss"], r["loss_scale"]) for r in resumed if "loss" in r] == logged
