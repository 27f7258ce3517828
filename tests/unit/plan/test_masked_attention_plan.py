"""Masked attention in the plan and in MFU: a sliding window W counts min(W, s) keys per query
(against torch's FlopCounterMode over a banded attention that computes exactly W keys per query),
and the masks SDPA keeps for backward (a window's s², documents' b·s²) are activations, measured
with saved-tensor hooks on the real model."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megaframe.config.schema import ModelConfig
from megaframe.model.dims import window_pattern
from megaframe.model.factory import resolve_dims
from megaframe.model.gpt import GPT
from megaframe.plan.activations import ActivationShape, stage_activation_bytes
from megaframe.tracking.flops import flops_per_token, matmul_parameters
from tests.support.saved_tensors import saved_bytes

B, H, T, D = 2, 4, 64, 16


def _attention_flops(attend) -> int:
    """FLOPs torch counts in one forward and backward of attend(q, k, v) on (B, H, T, D) inputs."""
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        attend(q, k, v).sum().backward()
    return counter.get_total_flops()


def _banded(window: int):
    """Attention that computes W keys per query and no more: each query's last W keys (zeros before
    the first token, masked out), gathered by unfold, then two batched matmuls."""
    def attend(q, k, v):
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, window - 1, 0)).unfold(2, window, 1)  # (B, H, T, D, W)
        scores = torch.einsum("bhtd,bhtdw->bhtw", q, pad(k)) / D ** 0.5
        keys = torch.arange(T).unsqueeze(1) - (window - 1) + torch.arange(window)  # each slot's key position
        weights = scores.masked_fill(keys < 0, float("-inf")).softmax(-1)
        return torch.einsum("bhtw,bhtdw->bhtd", weights, pad(v))
    return attend


def _dims(**keys):
    cfg = ModelConfig(num_layers=4, hidden_size=H * D, num_attention_heads=H, seq_length=T, vocab_size=96, **keys)
    return resolve_dims(cfg, 96)


@pytest.mark.parametrize("window", [8, 24])
def test_windowed_attention_flops_are_a_banded_kernels(window):
    """Per layer and token the formula's attention term is what torch counts in a kernel computing
    exactly W keys per query; for W >= s, what SDPA's math kernel counts for plain causal attention
    (the causal triangle is not subtracted: the convention of the unmasked count)."""
    dims = _dims(sliding_window=window)
    per_layer = (flops_per_token(dims) - 6 * matmul_parameters(dims)) / dims.num_layers
    assert per_layer * B * T == _attention_flops(_banded(window))
    causal = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        full = _attention_flops(causal)
    wide = _dims(sliding_window=T)  # a window as long as the sequence restricts nothing
    assert (flops_per_token(wide) - 6 * matmul_parameters(wide)) / wide.num_layers * B * T == full


def test_a_window_pattern_counts_its_global_layers_in_full():
    """Gemma-style [1, 1, 0] over 4 layers: blocks 0, 1 and 3 windowed, block 2 global."""
    windowed, plain = _dims(sliding_window=8, window_attn_skip_freq=None), _dims()
    dims = dataclasses.replace(windowed, window_pattern=window_pattern([1, 1, 0]))
    attention = lambda d: flops_per_token(d) - 6 * matmul_parameters(d)
    assert attention(dims) == pytest.approx(attention(windowed) * 3 / 4 + attention(plain) / 4)


@pytest.mark.parametrize("pattern", [(), (1, 0), (1, 1, 0), (0, 1, 1, 1, 0)])
def test_windowed_blocks_are_counted_by_the_patterns_period(pattern):
    dims = dataclasses.replace(_dims(sliding_window=8), num_layers=23, window_pattern=pattern)
    for start, stop in [(0, 23), (3, 17), (5, 6), (9, 9), (1, 22)]:
        assert dims.windowed_blocks_in(start, stop) == sum(dims.window_of(i) is not None for i in range(start, stop))
    assert dataclasses.replace(dims, sliding_window=T).windowed_blocks_in(0, 23) == 0  # W >= s: no window


FLAVOURS = {"gpt2": {}, "llama": dict(arch="llama", norm="rmsnorm", activation="swiglu", position_embedding="rope",
                                       tie_embeddings=False, bias=False, num_kv_heads=2)}
MASKS = {"window": dict(sliding_window=32), "pattern": dict(sliding_window=32, window_pattern=(1, 0)),
         "documents": dict(document_mask=True, eod_id=7)}


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_kept_masks_are_activations(flavour, dtype, mask):
    """What a masked model saves beyond the causal one, against the planner's difference: the mask
    SDPA keeps per windowed block (s² in the activation dtype), per block and sample with documents,
    and with documents the per-token positions (learned) or cos/sin rows (RoPE)."""
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=256,
                      **FLAVOURS[flavour])
    plain = resolve_dims(cfg, 256)
    masked = dataclasses.replace(plain, **MASKS[mask])
    idx = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    measured = []
    for dims in (plain, masked):
        torch.manual_seed(0)
        model = GPT(dims).train()
        measured.append(saved_bytes(model.to(torch.bfloat16) if dtype == "bf16" else model, idx))
    shape = ActivationShape(4, dtype=dtype, device="cpu")
    planned = [stage_activation_bytes(d, shape, 2, True, True, False) for d in (plain, masked)]
    # documents under learned positions: the causal model's (s,) position ids, 1 KiB, are not planned
    assert planned[1] - planned[0] == pytest.approx(measured[1] - measured[0], abs=1024)
    assert planned[1] > planned[0]


def test_flex_keeps_no_dense_mask():
    """model.attention_core=flex attends through a BlockMask (lists of 128-wide tiles), built once a
    forward and shared by the blocks; the plan charged each block the dense s² mask SDPA keeps (4 GiB a
    micro-batch for llama3_8b's 32 blocks at 8k with documents). The BlockMask, built here as FlexCore
    builds it, is a thousandth of one such mask."""
    from megaframe.model.attention import FlexCore, Mask
    from megaframe.plan.activations import attention_mask_bytes

    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=1024, vocab_size=256,
                      **FLAVOURS["llama"])
    sdpa = dataclasses.replace(resolve_dims(cfg, 256), document_mask=True, eod_id=7)
    flex = dataclasses.replace(sdpa, attention_core="flex")
    shape = ActivationShape(2, dtype="bf16", device="cpu")
    documents = torch.cat([torch.zeros(2, 512, dtype=torch.long), torch.ones(2, 512, dtype=torch.long)], dim=1)
    blocks = FlexCore(0.0).prepare(Mask(True, documents, None), 1024, "cpu").blocks
    held = sum(t.numel() * t.element_size() for t in blocks.as_tuple() if isinstance(t, torch.Tensor))
    assert 0 < held < attention_mask_bytes(sdpa, shape) / 1000
    assert attention_mask_bytes(flex, shape) == 0
