"""megaframe.load_model (and so megaframe-sample and megaframe-eval) reads a checkpoint's weights,
not its optimizer state: a training checkpoint's AdamW moments and fp32 master copy were read whole
and dropped, about three times the model's fp32 bytes of host memory at the peak (140 GB at 7B)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megaframe.checkpoint import sharded
from megaframe.config.schema import ModelConfig, MoEConfig
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


def _write(path, cfg: ModelConfig, state: dict | None = None, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    model = {name: torch.randn(shape, generator=generator) * 0.05
             for name, shape in canonical_shapes(resolve_dims(cfg, cfg.vocab_size)).items()}
    write_layout_free(path, model, {"step": 1, "consumed_samples": 0, "model": dataclasses.asdict(cfg),
                                    **(state or {})})
    return model


def test_a_bias_balanced_moe_routes_with_its_trained_biases():
    """DeepSeek-V3's aux-loss-free balancing: the biases pick the experts, so a model loaded without
    them routes tokens elsewhere than it was trained to (they were left at zero). They live in the
    checkpoint's state (router_biases), not among its tensors."""
    import tempfile
    from pathlib import Path

    moe = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=2, num_kv_heads=2,
                      ffn_hidden_size=64, vocab_size=50, seq_length=16, norm="rmsnorm", activation="swiglu",
                      position_embedding="rope", tie_embeddings=False,
                      moe=MoEConfig(num_experts=4, top_k=1, ffn_hidden_size=16, bias_update_rate=0.01))
    biases = {"0": [0.5, -0.5, 0.25, -0.25], "1": [-1.0, 1.0, 0.0, 0.125]}
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp) / "ckpt", moe, {"router_biases": biases})
        loaded = load_model(Path(tmp) / "ckpt")
        _write(Path(tmp) / "older", moe)  # saved before the state recorded them
        with pytest.warns(UserWarning, match="holds none .* it routes with them at zero"):
            load_model(Path(tmp) / "older")
        with pytest.raises(ValueError, match="dtype=torch.int8: a model's weights take a floating-point dtype"):
            load_model(Path(tmp) / "older", dtype=torch.int8)
    assert {str(layer.row): layer.router.expert_bias.tolist() for layer in loaded.moe_layers} == biases
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_biases = loaded.logits(idx)
        for layer in loaded.moe_layers:
            layer.router.expert_bias.zero_()
        assert not torch.allclose(loaded.logits(idx), with_biases)  # they change what the model says


def test_loading_holds_the_model_in_its_dtype_and_one_tensor_beside_it(tmp_path):
    """Built on the device in the asked dtype and filled tensor by tensor from the memory-mapped files:
    the resident set rises by the bf16 model and about one fp32 tensor. The whole fp32 state dict plus
    an fp32 model, then the bf16 copy, rose by five times the bf16 model."""
    from tests.support.memory_probe import fixed_mmap_threshold, peak_rss

    wide = ModelConfig(arch="llama", num_layers=6, hidden_size=512, num_attention_heads=8, num_kv_heads=8,
                       ffn_hidden_size=1536, vocab_size=256, seq_length=16, norm="rmsnorm", activation="swiglu",
                       position_embedding="rope", tie_embeddings=False)
    written = _write(tmp_path / "ckpt", wide)
    fixed_mmap_threshold()
    with peak_rss() as peak:
        loaded = load_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    model_bytes = sum(p.numel() * p.element_size() for p in loaded.parameters())
    largest = max(t.numel() * t.element_size() for t in written.values())
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16} and model_bytes > 30 * 2**20
    assert peak["extra"] <= model_bytes + 3 * largest + 8 * 2**20, (peak["extra"], model_bytes, largest)
    back = full_state_dict(loaded)
    assert all(torch.equal(back[name].float(), written[name].bfloat16().float()) for name in written)
