"""megaframe-convert never holds the whole model: both directions go one output tensor at a time.

A 22M-parameter GPT-2-flavour checkpoint (88 MB of fp32) is exported to HF and imported back in
this process; the resident memory each conversion adds at its peak (the kernel's high-water mark)
must stay under 20% of the model (what the converter held before: the whole state dict, 100%, plus
its copy on writing). The values are checked against the original tensors (the logits against
transformers are checked by test_hf_roundtrip.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from tests.support.memory_probe import fixed_mmap_threshold, peak_rss  # noqa: E402

from megaframe.config.schema import ModelConfig, MoEConfig  # noqa: E402
from megaframe.convert.cli import export_hf, import_hf  # noqa: E402
from megaframe.convert.files import read_layout_free, write_layout_free  # noqa: E402
from megaframe.model.dims import resolve_dims  # noqa: E402
from megaframe.model.full_state import canonical_shapes  # noqa: E402

CFG = ModelConfig(arch="gpt2", num_layers=7, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                  vocab_size=300, seq_length=64)


def test_conversion_holds_one_tensor_at_a_time(tmp_path):
    from transformers import AutoTokenizer, GPT2Config  # noqa: F401  (imported before measuring: ~30 MB of code)

    fixed_mmap_threshold()
    generator = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=generator)
             for name, shape in canonical_shapes(resolve_dims(CFG, CFG.vocab_size)).items()}
    model_bytes = 4 * sum(t.numel() for t in model.values())
    assert model_bytes >= 80e6
    write_layout_free(tmp_path / "ckpt", model, {"step": 1, "consumed_samples": 0, "model": dataclasses.asdict(CFG)})

    with peak_rss() as export_peak:
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    with peak_rss() as import_peak:
        import_hf(tmp_path / "hf", tmp_path / "back")
    print(f"peak extra RSS: export {export_peak['extra'] / 1e6:.1f} MB, import {import_peak['extra'] / 1e6:.1f} MB, "
          f"model {model_bytes / 1e6:.1f} MB")
    assert export_peak["extra"] < 0.2 * model_bytes, (export_peak["extra"], model_bytes)
    assert import_peak["extra"] < 0.2 * model_bytes, (import_peak["extra"], model_bytes)

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        q = model["blocks.3.attn.q_proj.weight"]
        assert torch.equal(f.get_tensor("transformer.h.3.attn.c_attn.weight")[:, : q.shape[0]], q.t())
        assert torch.equal(f.get_tensor("transformer.h.6.mlp.c_proj.weight"), model["blocks.6.mlp.down_proj.weight"].t())
    _, back = read_layout_free(tmp_path / "back")
    assert back.keys() == model.keys()
    for name, value in model.items():
        assert torch.equal(back[name], value), name


MOE_CFG = ModelConfig(arch="llama", num_layers=12, hidden_size=256, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=384, vocab_size=300, seq_length=64, norm="rmsnorm", activation="swiglu",
                      position_embedding="rope", tie_embeddings=False, bias=False,
                      moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=384))


def test_moe_conversion_holds_one_tensor_at_a_time(tmp_path):
    """A 31M-parameter Mixtral-shaped checkpoint: the export writes one HF tensor per expert, each
    read alone out of the stacked (E, out, in) tensor; the import stacks them back one at a time."""
    from transformers import MixtralConfig  # noqa: F401  (imported before measuring)

    fixed_mmap_threshold()
    generator = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=generator)
             for name, shape in canonical_shapes(resolve_dims(MOE_CFG, MOE_CFG.vocab_size)).items()}
    model_bytes = 4 * sum(t.numel() for t in model.values())
    assert model_bytes >= 120e6
    write_layout_free(tmp_path / "ckpt", model, {"step": 1, "consumed_samples": 0,
                                                 "model": dataclasses.asdict(MOE_CFG)})

    with peak_rss() as export_peak:
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    with peak_rss() as import_peak:
        import_hf(tmp_path / "hf", tmp_path / "back")
    print(f"MoE peak extra RSS: export {export_peak['extra'] / 1e6:.1f} MB, import {import_peak['extra'] / 1e6:.1f} MB, "
          f"model {model_bytes / 1e6:.1f} MB")
    assert export_peak["extra"] < 0.2 * model_bytes, (export_peak["extra"], model_bytes)
    assert import_peak["extra"] < 0.2 * model_bytes, (import_peak["extra"], model_bytes)

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.5.block_sparse_moe.experts.3.w3.weight"),
                           model["blocks.5.mlp.experts.up_proj"][3])
    _, back = read_layout_free(tmp_path / "back")
    assert back.keys() == model.keys()
    for name, value in model.items():
        assert torch.equal(back[name], value), name
