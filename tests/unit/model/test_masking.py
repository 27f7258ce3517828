"""Document masking and sliding windows (model/masking.py, the SDPA core's masks; issue 54).

The oracle shares no code with the implementation: documents of L tokens packed two to a sample of
2L tokens with data.document_mask train to the per-step losses of the same documents one per sample
of L tokens (twice the batch, the same tokens per step). The masked core is checked against
attention written out per document and window; the packing's positions against a hand count."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from megaframe.config.schema import DataConfig, ModelConfig
from megaframe.data.dataset import windows_batch
from megaframe.model.attention import CAUSAL, Mask, RingCore, SDPACore, UlyssesCore
from megaframe.model.dims import document_dims, resolve_dims
from megaframe.model.gpt import GPT, init_parameters
from megaframe.model.masking import split_documents
from megaframe.parallel.context import ContextGroup

VOCAB, EOD = 50, 49
GPT2 = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=16,
                    norm="rmsnorm", activation="swiglu", position_embedding="rope", tie_embeddings=False, bias=False)


def _model(cfg: ModelConfig, document_mask: bool = False, eod_mask_loss: bool = False) -> GPT:
    dims = document_dims(resolve_dims(cfg, VOCAB), DataConfig(document_mask=document_mask,
                                                              eod_mask_loss=eod_mask_loss), EOD)
    model = GPT(dims)
    init_parameters(model, "", dims, seed=3)
    return model


def test_documents_and_positions_restart_after_each_eod():
    idx = torch.tensor([[5, EOD, 7, 8, EOD, 9], [EOD, EOD, 1, 2, 3, 4]])
    docs = split_documents(idx, EOD)
    assert docs.ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]


def _reference(q, k, v, ids, window):
    """Attention written out per row and document: each document's tokens alone, causal, the
    window counted within it (a window never crosses a document either)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for doc in ids[b].unique():
            at = (ids[b] == doc).nonzero().flatten()
            qd, kd, vd = q[b][:, at], k[b][:, at], v[b][:, at]
            scores = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
            i = torch.arange(len(at)).unsqueeze(1)
            j = torch.arange(len(at)).unsqueeze(0)
            hidden = (j > i) | ((i - j >= window) if window else torch.zeros_like(j > i))
            out[b][:, at] = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ vd
    return out


@pytest.mark.parametrize("kv_heads, gqa, window", [(4, False, None), (2, True, 3), (2, False, 2)])
def test_the_sdpa_core_attends_within_documents_and_windows(kv_heads, gqa, window):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 12, 8, generator=g) for _ in range(2))
    if not gqa and kv_heads != 4:  # the block indexes kv heads itself when SDPA does not repeat them
        k, v = (t.repeat_interleave(4 // kv_heads, 1) for t in (k, v))
    idx = torch.randint(0, 6, (2, 12), generator=g)
    idx[0, [2, 7]] = EOD
    idx[1, [0, 11]] = EOD
    ids = split_documents(idx, EOD).ids
    core = SDPACore(0.0, None, gqa=gqa)
    got = core(q, k, v, Mask(documents=ids, window=window))
    torch.testing.assert_close(got, _reference(q, k, v, ids, window), rtol=1e-5, atol=1e-6)


def test_a_window_as_long_as_the_sequence_is_no_window_bitwise():
    ref = _model(LLAMA)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    for window in (16, 100):
        windowed = _model(dataclasses.replace(LLAMA, sliding_window=window))
        assert torch.equal(windowed.logits(idx), ref.logits(idx)), window
    short = _model(dataclasses.replace(LLAMA, sliding_window=4))  # and a shorter one changes them
    assert not torch.allclose(short.logits(idx), ref.logits(idx))


@pytest.mark.parametrize("freq, windowed", [(None, [1, 1, 1, 1, 1]), (2, [1, 0, 1, 0, 1]), (1, [0, 0, 0, 0, 0]),
                                            ([1, 1, 0], [1, 1, 0, 1, 1]), ([0, 1, 1, 1, 1], [0, 1, 1, 1, 1])])
def test_each_block_takes_its_window_from_the_pattern(freq, windowed):
    cfg = dataclasses.replace(GPT2, num_layers=5, sliding_window=6, window_attn_skip_freq=freq)
    model = GPT(resolve_dims(cfg, VOCAB))
    assert [block.attn.mask.window for block in model.blocks] == [6 if w else None for w in windowed]


def _documents(count: int, length: int, seed: int) -> torch.Tensor:
    """A token stream of `count` documents of `length` tokens, each ending in EOD, plus one token
    (a last sample's last target)."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.randint(0, EOD, (count, length), generator=g)
    docs[:, -1] = EOD
    return torch.cat([docs.flatten(), docs[0, :1]])


def _windows(stream: torch.Tensor, seq: int, first: int, count: int,
             unlearned_after: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of samples first..first+count-1 of seq tokens, cut by data/dataset.py."""
    return windows_batch([stream[i * seq: i * seq + seq + 1].numpy() for i in range(first, first + count)],
                         unlearned_after=unlearned_after)


def _losses(model: GPT, stream: torch.Tensor, seq: int, batch: int, steps: int) -> list[float]:
    """Per-step losses of a plain AdamW loop over the stream's samples in order."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for step in range(steps):
        loss = model(*_windows(stream, seq, step * batch, batch, model.dims.unlearned_after))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cfg, eod_mask_loss", [(GPT2, False), (LLAMA, True)], ids=["gpt2", "llama"])
def test_packed_documents_train_as_one_document_per_sample(cfg, eod_mask_loss):
    """Two documents of L tokens per sample (seq 2L, batch B, document_mask) give the losses of one
    per sample (seq L, batch 2B) step by step; without the mask they do not."""
    L, B, steps = 8, 2, 4
    stream = _documents(2 * B * steps, L, seed=2)
    # one model shape for both (seq_length 2L), so both start from the same weights; the short run
    # feeds it L tokens, positions 0..L-1, as a model of seq_length L would see them
    packed = _losses(_model(cfg, document_mask=True, eod_mask_loss=eod_mask_loss), stream, 2 * L, B, steps)
    single = _losses(_model(cfg, eod_mask_loss=eod_mask_loss), stream, L, 2 * B, steps)
    assert packed == pytest.approx(single, rel=1e-5, abs=1e-6)
    unmasked = _losses(_model(cfg, eod_mask_loss=eod_mask_loss), stream, 2 * L, B, steps)
    assert max(abs(a - b) for a, b in zip(unmasked, single)) > 1e-3


def test_eod_mask_loss_leaves_out_the_target_after_each_end_of_document_as_megatron_does():
    """Megatron's --eod-mask-loss, written out: loss_mask[tokens == eod] = 0 over the inputs (its
    _get_ltor_masks_and_position_ids gets tokens = text[:-1]), the loss the mean over the mask. The
    target after each end-of-document token is left out; the end-of-document targets are learned.
    megaframe left those out instead (targets == eod) until 2026-11-29."""
    model = _model(GPT2, eod_mask_loss=True)
    text = _documents(4, 5, seed=4)[:17].unsqueeze(0)
    tokens, labels = text[:, :-1], text[:, 1:]
    loss_mask = torch.ones(tokens.shape)
    loss_mask[tokens == EOD] = 0.0
    per_token = F.cross_entropy(model.logits(tokens).flatten(0, 1), labels.flatten(), reduction="none")
    expected = (per_token * loss_mask.flatten()).sum() / loss_mask.sum()
    idx, targets = _windows(text[0], 16, 0, 1, model.dims.unlearned_after)
    ends = labels == EOD  # end-of-document targets: learned
    assert torch.equal(idx, tokens) and ends.sum() == 3 and torch.equal(targets[ends], labels[ends])
    torch.testing.assert_close(model(idx, targets), expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(model(tokens, labels), expected)  # every target counted
    assert _model(GPT2).dims.unlearned_after is None


def test_the_context_parallel_cores_take_document_and_window_masks_but_not_a_non_causal_one():
    one = ContextGroup(group=None, ranks=(0,), rank=0)
    for core in (RingCore(0.0, None, one), UlyssesCore(0.0, None, one)):
        assert core.supports(CAUSAL)
        assert core.supports(Mask(window=4))
        assert core.supports(Mask(documents=torch.zeros(1, 4, dtype=torch.long), window=2))
        assert not core.supports(Mask(causal=False))
    assert SDPACore(0.0, None, gqa=False).supports(Mask(documents=torch.zeros(1, 4, dtype=torch.long), window=2))


def test_generation_of_a_windowed_model_applies_its_window():
    """The key/value cache attends to every cached key, so a windowed model generates through its
    cores: greedy tokens beyond the window are those of the full forward's argmax, step by step."""
    model = _model(dataclasses.replace(LLAMA, sliding_window=3)).eval()
    with torch.no_grad():
        for param in model.parameters():  # a sharper model: the window's effect shows in the argmax
            param.mul_(8.0)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    got = model.generate(prompt, max_new_tokens=6, temperature=0)
    want = prompt
    with torch.no_grad():
        for _ in range(6):
            want = torch.cat([want, model.logits(want)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, want)



@pytest.mark.parametrize("document_mask, windows", [(True, [3, None]), (False, [3])], ids=["documents", "windows"])
def test_each_distinct_mask_is_built_once_per_forward(document_mask, windows, monkeypatch):
    """Four blocks alternating window and global attention build two dense masks per forward with
    documents (the windowed one and the documents' own) and one without (the global blocks attend
    plainly causally), not one per block."""
    cfg = dataclasses.replace(LLAMA, num_layers=4, sliding_window=3, window_attn_skip_freq=2)
    model = _model(cfg, document_mask=document_mask)
    idx, targets = _windows(_documents(8, 4, seed=6), 16, 0, 2)
    built = []
    allowed = Mask.allowed
    monkeypatch.setattr(Mask, "allowed", lambda self, *a: built.append(self.window) or allowed(self, *a))
    model(idx, targets).backward()
    assert sorted(built, key=str) == sorted(windows, key=str), built


def test_a_stage_without_the_token_ids_refuses_to_attend_across_documents():
    """A pipeline stage after the first that was not handed the token ids under data.document_mask
    stops with a ValueError rather than attend across the documents it cannot see."""
    from megaframe.model.gpt import forward_layers

    model = _model(GPT2, document_mask=True)
    hidden = torch.zeros(1, 16, GPT2.hidden_size)
    with pytest.raises(ValueError, match="token ids"):
        forward_layers(model, hidden, 16, model.blocks)
    ids = torch.full((1, 16), EOD)
    assert forward_layers(model, hidden, 16, model.blocks, token_ids=ids).shape == hidden.shape
