"""full_state_dict / load_full_state at tp=1 (tp=2 is covered by tests/dist/test_hf_import.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.model.full_state import StateMismatch, canonical_shapes, full_state_dict, load_full_state
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200)


def _model(cfg: ModelConfig, seed: int):
    return build_model(resolve_dims(cfg, cfg.vocab_size), ParallelState(ParallelDims(), rank=0), seed=seed).eval()


def test_full_state_is_unpadded_and_loads_into_another_model():
    source, target = _model(CFG, seed=1), _model(CFG, seed=2)
    full = full_state_dict(source)
    assert full["embed.tok.weight"].shape == (200, 32)  # 256 padded rows in the module
    assert {k: tuple(v.shape) for k, v in full.items()} == canonical_shapes(source.dims)
    load_full_state(target, full)
    ids = torch.randint(0, 200, (2, 16))
    assert torch.equal(source.logits(ids), target.logits(ids))
    assert torch.count_nonzero(target.embed.tok.weight[200:]) == 0  # padding rows are zeros


def test_mismatching_state_is_refused_in_one_line():
    full = full_state_dict(_model(CFG, seed=1))
    wider = _model(dataclasses.replace(CFG, ffn_hidden_size=64), seed=1)
    with pytest.raises(StateMismatch, match=r"blocks.0.mlp.up_proj.weight has shape \[128, 32\] but the model expects \[64, 32\]"):
        load_full_state(wider, full)
    deeper = _model(dataclasses.replace(CFG, num_layers=3), seed=1)
    with pytest.raises(StateMismatch, match="missing"):
        load_full_state(deeper, full)
