"""FlexCore (model/attention.py: FlexAttention with block masks, model.attention_core=flex) against
SDPACore, the dense-mask reference: outputs and q/k/v gradients, and a model's training losses, for
causal, documents, window and both, gpt2 and llama (GQA) shapes.

torch refuses FlexAttention's backward on the CPU (its compiled CPU kernel has none), so the
gradient tests lift that guard (`cpu_backward`): eager flex_attention then runs torch's math
reference, which differentiates, through the same block mask and mask_mod megaframe builds; the
config refuses flex for CPU training (config/attention_rules.py). tests/gpu runs the compiled kernel."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from megaframe.config.schema import ModelConfig
from megaframe.model.attention import CAUSAL, FlexCore, Mask, RingCore, SDPACore, build_attention_core
from megaframe.model.dims import attention_core_of
from megaframe.model.masking import split_documents
from megaframe.parallel.context import ContextGroup
from tests.unit.model.test_masking import EOD, GPT2, LLAMA, _documents, _losses, _model

# more than one 128-token tile each way, so the block mask has empty, partial and full tiles
SEQ = 300


@pytest.fixture
def cpu_backward(monkeypatch):
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)


def _mask(kind: str) -> Mask:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 40, (2, SEQ), generator=g)
    tokens[0, [40, 170, 171, 250]] = EOD  # documents crossing tile edges, one of a single token
    tokens[1, [130]] = EOD
    ids = split_documents(tokens, EOD).ids
    return {"causal": CAUSAL, "documents": Mask(documents=ids), "window": Mask(window=50),
            "documents+window": Mask(documents=ids, window=50)}[kind]


def _qkv(heads: int, kv_heads: int, hs: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, n, SEQ, hs, generator=g, requires_grad=True) for n in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("kind", ["causal", "documents", "window", "documents+window"])
@pytest.mark.parametrize("heads, kv_heads, hs", [(4, 4, 16), (4, 2, 8)], ids=["gpt2", "llama-gqa"])
def test_flex_core_equals_the_sdpa_core(kind, heads, kv_heads, hs, cpu_backward):
    mask = _mask(kind)
    gqa = kv_heads != heads
    flex, sdpa = FlexCore(0.0), SDPACore(0.0, None, gqa)
    prepared = flex.prepare(mask, SEQ, "cpu")  # once per forward, as ForwardMasks does
    assert (prepared.blocks is None) == (kind == "causal")
    results = []
    for core, m in ((flex, prepared), (sdpa, sdpa.prepare(mask, SEQ, "cpu"))):
        q, k, v = _qkv(heads, kv_heads, hs)
        y = core(q, k, v, m)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()  # a non-uniform gradient
        results.append([y.detach(), q.grad, k.grad, v.grad])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, (a - b).abs().max())
    if kind == "causal":  # no restriction: SDPA's own is_causal call, bitwise
        assert torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama-gqa"])
def test_a_model_trains_on_flex_as_on_sdpa(cfg, cpu_backward):
    """Document masking and windows on every other layer: a short AdamW run's losses match."""
    cfg = dataclasses.replace(cfg, sliding_window=5, window_attn_skip_freq=2)
    stream = _documents(16, 6, seed=4)  # 96 tokens + 1: 3 steps of 2 samples of 16
    runs = {core: _losses(_model(dataclasses.replace(cfg, attention_core=core), document_mask=True), stream, 16, 2, 3)
            for core in ("sdpa", "flex")}
    assert isinstance(_model(dataclasses.replace(cfg, attention_core="flex")).blocks[0].attn.core, FlexCore)
    assert runs["flex"] == pytest.approx(runs["sdpa"], rel=1e-5, abs=1e-6)


def test_the_core_is_chosen_from_the_key_device_and_layout():
    assert attention_core_of(ModelConfig(), "cpu") == "sdpa"  # CPU runs keep their path
    assert attention_core_of(ModelConfig(), None) == "sdpa"  # no training device (planner, converters)
    assert attention_core_of(ModelConfig(), "cuda") == "sdpa"  # flex opt-in until a GPU runs tests/gpu
    assert attention_core_of(ModelConfig(dropout=0.1), "cuda") == "sdpa"  # flex has no attention dropout
    assert attention_core_of(ModelConfig(attention_core="flex"), "cpu") == "flex"
    assert attention_core_of(ModelConfig(attention_core="sdpa"), "cuda") == "sdpa"
    assert isinstance(build_attention_core(0.0, None, False, kind="flex"), FlexCore)
    assert isinstance(build_attention_core(0.0, None, False), SDPACore)
    one = ContextGroup(group=None, ranks=(0,), rank=0)
    assert isinstance(build_attention_core(0.0, None, False, one, "ring", kind="flex"), RingCore)
    with pytest.raises(ValueError, match="model.attention_core=sdpa"):
        FlexCore(0.1)


def test_compiled_blocks_take_the_block_mask_without_a_graph_break():
    """train.compile compiles each block with the prepared mask as an input: FlexCore's forward
    traces whole (fullgraph) and gives the eager logits (dynamo only: the CPU needs no inductor)."""
    cfg = dataclasses.replace(LLAMA, sliding_window=5, window_attn_skip_freq=2, attention_core="flex")
    model = _model(cfg, document_mask=True)
    idx = _documents(4, 8, seed=1)[:32].view(2, 16)
    with torch.no_grad():
        eager = model.logits(idx)
        for block in model.blocks:
            block.compile(backend="eager", fullgraph=True)
        assert torch.equal(model.logits(idx), eager)


def test_on_cuda_the_block_mask_builder_is_torch_compiled_without_the_deprecated_flag():
    """On a GPU the mask's blocks are built by torch.compile(create_block_mask), once per process, as
    torch asks instead of its deprecated _compile=True (a DeprecationWarning at every mask built):
    picked here without a GPU, nothing is built or compiled (so no warning could show here)."""
    from megaframe.model.attention import _flex_functions

    flex, build = _flex_functions("cuda")
    assert getattr(build, "_torchdynamo_orig_callable", None) is torch_flex.create_block_mask
    assert getattr(flex, "_torchdynamo_orig_callable", None) is torch_flex.flex_attention
    assert _flex_functions("cuda")[1] is build
    assert _flex_functions("cpu") == (torch_flex.flex_attention, torch_flex.create_block_mask)
