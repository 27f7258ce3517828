"""The model on one process: flavours, layout-invariant init, causality, GQA, padded vocabulary."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import build_model, count_parameters, resolve_dims
from megaframe.model.gpt import GPT, full_init_value, init_parameters
from megaframe.parallel.layers import TPGroup, mark_shard
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

ONE_RANK = ParallelState(ParallelDims(), rank=0)
GPT2 = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    seq_length=16, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                    tie_embeddings=False, bias=False)


def _model(cfg: ModelConfig, seed: int = 7) -> GPT:
    return build_model(resolve_dims(cfg, 100), ONE_RANK, seed)


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_init_depends_only_on_seed_and_name(cfg):
    a, b, c = _model(cfg, 7), _model(cfg, 7), _model(cfg, 8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "weight" in name and "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_sharded_parameter_gets_its_slice_of_the_full_value():
    dims = resolve_dims(GPT2, 100)
    full = full_init_value("blocks.0.attn.q_proj.weight", (64, 64), dims, seed=3)
    shard = torch.nn.Linear(64, 32, bias=False)
    mark_shard(shard.weight, (64, 64), 0, TPGroup(size=2, rank=1))
    init_parameters(shard, "blocks.0.attn.q_proj", dims, seed=3)
    assert torch.equal(shard.weight, full[32:])


def test_flavours_have_the_expected_modules():
    gpt2, llama = _model(GPT2), _model(LLAMA)
    assert gpt2.head is None and gpt2.embed.pos is not None
    assert type(gpt2.final_norm).__name__ == "LayerNorm" and type(llama.final_norm).__name__ == "RMSNorm"
    assert llama.head is not None and llama.embed.pos is None
    assert llama.blocks[0].attn.k_proj.weight.shape == (2 * 16, 64)  # 2 kv heads of size 16
    assert not any(n.endswith("bias") for n, _ in llama.named_parameters())


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_causal_and_real_vocabulary_only(cfg):
    model = _model(cfg).eval()
    idx = torch.randint(0, 100, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 100
    out, out_changed = model.logits(idx), model.logits(changed)
    assert out.shape == (2, 16, 100)  # padded vocabulary (128) rows never show up as logits
    assert torch.allclose(out[:, :10], out_changed[:, :10], atol=1e-6)  # same shapes, same kernels: equal up to ulps
    assert not torch.allclose(out[:, 10:], out_changed[:, 10:])
    loss = model(idx, idx).item()
    # our log-sum-exp over 128 padded rows vs torch's over 100: a few fp32 ulps of a loss of O(5)
    assert loss == pytest.approx(F.cross_entropy(out.reshape(-1, 100), idx.reshape(-1)).item(), rel=1e-6)


def test_grouped_query_attention_equals_repeated_kv_heads():
    """GQA with 2 kv heads = full multi-head attention whose k/v weights repeat each kv head."""
    gqa = _model(LLAMA).eval()
    mha_cfg = dataclasses.replace(LLAMA, num_kv_heads=4)
    mha = _model(mha_cfg).eval()
    mha.load_state_dict({k: v for k, v in gqa.state_dict().items() if "k_proj" not in k and "v_proj" not in k},
                        strict=False)
    with torch.no_grad():
        for block_gqa, block_mha in zip(gqa.blocks, mha.blocks):
            for proj in ("k_proj", "v_proj"):
                w = getattr(block_gqa.attn, proj).weight.view(2, 16, 64)
                getattr(block_mha.attn, proj).weight.copy_(w.repeat_interleave(2, dim=0).reshape(64, 64))
    idx = torch.randint(0, 100, (2, 16))
    assert torch.allclose(gqa.logits(idx), mha.logits(idx), atol=1e-5)  # other SDPA paths: fp32 ulps of O(1) logits


def test_llama2_7b_parameter_count_matches_reference():
    """../shared/REFERENCE.md: Llama-2 7B has 6,738,415,616 parameters (built on the meta device)."""
    cfg = ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      ffn_hidden_size=11008, vocab_size=32000, seq_length=4096, norm="rmsnorm",
                      activation="swiglu", position_embedding="rope", tie_embeddings=False, bias=False)
    with torch.device("meta"):
        model = GPT(resolve_dims(cfg, 32000))
    assert count_parameters(model) == 6_738_415_616


def test_activation_checkpointing_gives_the_same_gradients():
    plain = _model(LLAMA)
    ckpt = build_model(resolve_dims(LLAMA, 100), ONE_RANK, 7, activation_checkpointing=True)
    idx = torch.randint(0, 100, (2, 16))
    plain(idx, idx).backward()
    ckpt(idx, idx).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name  # recomputation reorders accumulation only
