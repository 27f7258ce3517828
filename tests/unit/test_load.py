"""megaframe.load_model (and so megaframe-sample and megaframe-eval) reads a checkpoint's weights,
not its optimizer state: a training checkpoint's AdamW moments and fp32 master copy were read whole
and dropped, about three times the model's fp32 bytes of host memory at the peak (140 GB at 7B)."""
from __future__ import annotations

import dataclasses

import torch

from megaframe.checkpoint import sharded
from megaframe.config.schema import ModelConfig
from megaframe.convert.files import write_layout_free
from megaframe.load import load_model
from megaframe.model.dims import resolve_dims
from megaframe.model.full_state import canonical_shapes, full_state_dict

CFG = ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                  vocab_size=50, seq_length=16)


def test_load_model_reads_the_weights_and_leaves_the_optimizer_state_unread(tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=generator)
             for name, shape in canonical_shapes(resolve_dims(CFG, CFG.vocab_size)).items()}
    optimizer = {f"{state}.{name}": torch.randn(value.shape, generator=generator)
                 for name, value in model.items() for state in ("exp_avg", "exp_avg_sq", "master")}
    write_layout_free(tmp_path / "ckpt", {**model, **optimizer},
                      {"step": 1, "consumed_samples": 0, "model": dataclasses.asdict(CFG)})
    read, full = [], sharded.ShardReader.full

    def recording(reader, key):
        read.append(key)
        return full(reader, key)
    monkeypatch.setattr(sharded.ShardReader, "full", recording)
    loaded = load_model(tmp_path / "ckpt")
    assert sorted(read) == sorted(model), "read beyond the model's weights"
    back = full_state_dict(loaded)
    assert back.keys() == model.keys() and all(torch.equal(back[name], model[name]) for name in model)
