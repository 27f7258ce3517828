"""A trained checkpoint as a plain torch.nn.Module, for inference or analysis in a notebook:

    import megaframe
    model = megaframe.load_model("outputs/DATE/TIME/checkpoints")   # a run's latest, or one checkpoint
    loss = model(idx, targets)        # mean next-token loss
    logits = model.logits(idx)        # (B, T, vocab), the real vocabulary (no padded columns)

Any layout-free checkpoint loads, whichever layout and engine wrote it: its tensors are stored
whole with the vocabulary unpadded (checkpoint/universal.py). The model is megaframe's GPT at tp=1,
built on `device` in `dtype` and padded for it, then filled one tensor at a time from the
checkpoint's memory-mapped files: beside the model, the host holds one fp32 tensor (it held the
whole fp32 state dict and an fp32 model before, 8 bytes a parameter: 56 GB for a 7B loaded to a GPU
in bf16). The optimizer state is not read. A mixture-of-experts model trained with bias balancing
(model.moe.bias_update_rate) gets its routing biases from the checkpoint's state: without them it
would pick other experts than it was trained with. For a model larger than one device, convert it
to Hugging Face (megaframe-convert) and load it sharded there.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Union

import torch

from megaframe.model.gpt import GPT


def load_model(checkpoint: Union[str, Path], device: Union[str, torch.device] = "cpu",
               dtype: torch.dtype = torch.float32) -> GPT:
    """The GPT a layout-free checkpoint holds, in eval mode on `device` in `dtype`. `checkpoint`: a
    checkpoint directory, or a run's checkpoints/ directory (its `latest`). Raises ValueError with
    one line for anything that is not such a checkpoint."""
    from megaframe.convert.cli import model_config
    from megaframe.convert.files import model_tensors, open_layout_free
    from megaframe.model.factory import resolve_dims
    from megaframe.model.full_state import load_full_state
    from megaframe.model.moe import load_router_biases

    device = torch.device(device)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}: a model's weights take a floating-point dtype (torch.float32, "
                         f"torch.bfloat16 or torch.float16)")
    state, reader = open_layout_free(Path(checkpoint))  # verified against its manifest (the weights' files)
    with reader:
        tensors = model_tensors(reader)  # each read when copied in, then released
        cfg = model_config(state, Path(checkpoint))
        vocab = cfg.vocab_size or tensors.shapes["embed.tok.weight"][0]
        dims = resolve_dims(cfg, vocab, device_type=device.type)
        model = _empty_model(dims, device, dtype)
        with torch.no_grad():
            load_full_state(model, tensors)
            biases = state.get("router_biases") or {}
            if dims.moe is not None and dims.moe.bias_update_rate and not biases:
                warnings.warn(f"{checkpoint}: the model balances its experts with routing biases "
                              f"(model.moe.bias_update_rate) but the checkpoint holds none (saved before they were "
                              f"recorded): it routes with them at zero", stacklevel=2)
            load_router_biases(getattr(model, "moe_layers", []), biases)
    # anything the build made in another dtype or place (none today): as asked
    return model.to(device=device, dtype=dtype).eval()


def _empty_model(dims, device: torch.device, dtype: torch.dtype) -> GPT:
    """The GPT with its parameters allocated on `device` in `dtype`, not initialised (the checkpoint
    overwrites every one): no fp32 copy on the host first."""
    from megaframe.model.factory import build_model
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    # the process's default dtype for the build, as transformers' from_pretrained(torch_dtype=) sets it:
    # another thread making tensors meanwhile would get this dtype too
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return build_model(dims, ParallelState(ParallelDims(), rank=0), seed=0, initialise=False)
    finally:
        torch.set_default_dtype(default)
