"""Sliding-window models through Hugging Face's MistralForCausalLM (tiny random models built here,
no downloads): megaframe's logits equal transformers' on sequences longer than the window, after
export (to-hf) and after import (from-hf)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megaframe.config.schema import ModelConfig
from megaframe.convert.cli import export_hf, import_hf
from megaframe.convert.files import read_layout_free, write_layout_free
from megaframe.convert.hf import ConvertError, hf_architecture
from megaframe.model.factory import build_model, resolve_dims
from megaframe.model.full_state import full_state_dict
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

VOCAB = 120
MISTRAL = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=48, vocab_size=VOCAB, seq_length=32, norm="rmsnorm", norm_eps=1e-5,
                      activation="swiglu", position_embedding="rope", rope_theta=500.0, tie_embeddings=False,
                      bias=False, sliding_window=5)


def _model(cfg: ModelConfig, state=None) -> torch.nn.Module:
    """A tp=1 megaframe GPT: random (every parameter perturbed) or holding `state`."""
    model = build_model(resolve_dims(cfg, VOCAB, device_type="cpu"), ParallelState(ParallelDims(), rank=0), seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if state is not None:
                param.copy_(state[name])
            else:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 tokens > window 5


def test_a_windowed_model_exports_as_mistral_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model(MISTRAL)
    write_layout_free(tmp_path / "ckpt", full_state_dict(model), {"step": 1, "consumed_samples": 2,
                                                                   "model": dataclasses.asdict(MISTRAL)})
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MistralForCausalLM" and hf.config.sliding_window == 5
    with torch.no_grad():
        want, got = model.logits(_ids()), hf(_ids()).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # without the window the logits differ: the comparison sees the window
    unwindowed = _model(dataclasses.replace(MISTRAL, sliding_window=None), full_state_dict(model))
    with torch.no_grad():
        assert not torch.allclose(unwindowed.logits(_ids()), got, atol=1e-3)
    imported, _ = import_hf(tmp_path / "hf", tmp_path / "back")
    assert imported == MISTRAL


def test_a_mistral_model_imports_with_the_same_logits(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           sliding_window=6, rope_theta=10000.0, tie_word_embeddings=False)
    hf = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn(param.shape) * 0.2)
    hf.save_pretrained(tmp_path / "hf")
    cfg, _ = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert cfg.sliding_window == 6 and not cfg.bias
    _, tensors = read_layout_free(tmp_path / "ckpt")
    model = _model(cfg, tensors)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(_ids()), hf(_ids()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, key", [
    ({"window_attn_skip_freq": 2}, "model.window_attn_skip_freq=2"),
    ({"bias": True}, "model.bias=true"),
    ({"qk_norm": True}, "model.sliding_window=5"),
])
def test_windows_transformers_cannot_apply_are_refused_on_export(change, key):
    with pytest.raises(ConvertError) as refused:
        hf_architecture(dataclasses.replace(MISTRAL, **change))
    assert str(refused.value).startswith(key) and "\n" not in str(refused.value)
