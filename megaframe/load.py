"""A trained checkpoint as a plain torch.nn.Module, for inference or analysis in a notebook:

    import megaframe
    model = megaframe.load_model("outputs/DATE/TIME/checkpoints")   # a run's latest, or one checkpoint
    loss = model(idx, targets)        # mean next-token loss
    logits = model.logits(idx)        # (B, T, vocab), the real vocabulary (no padded columns)

Any layout-free checkpoint loads, whichever layout and engine wrote it: its tensors are stored
whole with the vocabulary unpadded (checkpoint/universal.py). The model is megaframe's GPT at tp=1,
built on `device` and padded for it. The whole model is read into memory once (its optimizer state is
not read); for a model larger than one host's memory, convert it to Hugging Face (megaframe-convert)
and load it sharded there.
"""
from __future__ import annotations

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
    from megaframe.convert.files import read_layout_free
    from megaframe.model.factory import build_model, resolve_dims
    from megaframe.model.full_state import load_full_state
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    state, tensors = read_layout_free(Path(checkpoint))  # verified against its manifest
    cfg = model_config(state, Path(checkpoint))
    vocab = cfg.vocab_size or tensors["embed.tok.weight"].shape[0]
    device = torch.device(device)
    dims = resolve_dims(cfg, vocab, device_type=device.type)
    # no initialisation: every parameter is overwritten from the checkpoint
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=0, initialise=False)
    with torch.no_grad():
        load_full_state(model, tensors)
    return model.to(device=device, dtype=dtype).eval()
