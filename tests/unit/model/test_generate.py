"""GPT.generate with its key/value cache: every step's logits are those of a full forward over the
cropped context (the training forward, no cache), also once the window slides and for every
attention variant (learned positions, RoPE, GQA by SDPA or by index, QK-norm, MoE with a
capacity); greedy and seeded sampling are reproducible; top-k, top-p and end of document act."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.model import generate as gen
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

ONE_RANK = ParallelState(ParallelDims(), rank=0)
VOCAB, WINDOW = 50, 16
GPT2 = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=WINDOW)
LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    seq_length=WINDOW, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                    tie_embeddings=False, bias=False)
MODELS = {"gpt2": GPT2, "llama-gqa": LLAMA, "llama-qk-norm-mqa": dataclasses.replace(LLAMA, qk_norm=True, num_kv_heads=1),
          "moe-capacity": dataclasses.replace(LLAMA, moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32,
                                                                   capacity_factor=0.5))}


def model_of(cfg: ModelConfig, seed: int = 3):
    # init_std 0.2: logits far from uniform, so that sampled tokens tell the paths apart
    dims = dataclasses.replace(resolve_dims(cfg, VOCAB, device_type="cpu"), init_std=0.2)
    return build_model(dims, ONE_RANK, seed).eval()


@pytest.mark.parametrize("name, kv_by_index", [("gpt2", False), ("llama-gqa", False), ("llama-gqa", True),
                                               ("llama-qk-norm-mqa", False), ("llama-qk-norm-mqa", True),
                                               ("moe-capacity", False)])
def test_each_steps_logits_are_the_full_forwards_of_the_cropped_context(name, kv_by_index, monkeypatch):
    if kv_by_index:  # torch < 2.5: the kv heads are repeated by index, not by SDPA
        monkeypatch.setattr("megaframe.model.gpt.SDPA_HAS_GQA", False)
    model = model_of(MODELS[name])
    seen = []
    pick = gen.pick_next
    monkeypatch.setattr(gen, "pick_next", lambda logits, *args: seen.append(logits) or pick(logits, *args))
    # 6 + 25 tokens: one-token steps on the cache, then the window slides; 20: a prompt cropped
    for length in (6, 20):
        seen.clear()
        prompt = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        out = model.generate(prompt, 25, temperature=1.0, seed=0)
        assert out.shape == (2, length + 25) and torch.equal(out[:, :length], prompt) and len(seen) == 25
        for step, logits in enumerate(seen):
            context = out[:, : length + step][:, -WINDOW:]  # nanoGPT's crop
            with torch.no_grad(), gen.dropless(model):
                full = model.logits(context)[:, -1]
            assert logits.shape == (2, VOCAB)
            torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5, msg=f"{name}: step {step}")
        # the tokens of the recompute (use_cache=False): the same draws from the same logits
        assert torch.equal(model.generate(prompt, 25, temperature=1.0, seed=0, use_cache=False), out)
    if name == "moe-capacity":  # the capacity, lifted for generation (it changes the logits), is back
        assert all(layer.moe.capacity_factor == 0.5 for layer in model.moe_layers)
        with torch.no_grad():
            assert not torch.allclose(model.logits(out[:, 4:20])[:, -1], seen[0], atol=1e-3)  # out: the 20-token prompt's


def test_the_cache_takes_a_prompt_in_chunks_after_a_past():
    """Several new tokens after cached ones attend causally, aligned to the end."""
    model = model_of(LLAMA)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = gen.KVCache(len(model.blocks), WINDOW)
    with torch.no_grad():
        gen.forward_cached(model, ids[:, :5], cache)
        logits = gen.forward_cached(model, ids[:, 5:], cache)
        torch.testing.assert_close(logits, model.logits(ids)[:, -1], atol=1e-5, rtol=1e-5)
    assert cache.length == 12
    with pytest.raises(ValueError, match="holds 16 positions"):
        gen.forward_cached(model, ids[:, :5], cache)


def test_greedy_is_deterministic_and_seeds_reproduce_samples():
    model = model_of(GPT2)
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(prompt, 10, temperature=0)
    assert torch.equal(greedy, model.generate(prompt, 10, temperature=0, seed=5))
    assert torch.equal(greedy, model.generate(prompt, 10, temperature=2.0, top_k=1, seed=6))  # top-k 1 is greedy
    with torch.no_grad():
        assert torch.equal(greedy[:, 4], model.logits(prompt)[:, -1].argmax(-1))
    a, b = model.generate(prompt, 10, seed=1), model.generate(prompt, 10, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, model.generate(prompt, 10, seed=2))
    generator = torch.Generator().manual_seed(1)
    assert torch.equal(model.generate(prompt, 10, generator=generator), a)
    assert model.training is False


def test_top_k_and_top_p_keep_only_their_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)

    def drawn(**cut) -> set[int]:
        return set(gen.pick_next(logits, 1.0, cut.get("top_k"), cut.get("top_p"), generator).flatten().tolist())

    assert drawn() == {0, 1, 2, 3}
    assert drawn(top_k=2) == {0, 1}
    assert drawn(top_p=0.7) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it: the third is out
    assert drawn(top_p=0.4) == {0}  # the most likely token always stays
    assert drawn(top_k=3, top_p=0.99) == {0, 1, 2}
    assert drawn(top_k=0, top_p=1.0) == {0, 1, 2, 3}  # 0 and 1: no cut
    low = set(gen.pick_next(logits, 0.05, None, None, generator).flatten().tolist())
    assert low == {0}  # a low temperature sharpens
    for tiny in (1e-40, 1e-45, 1e-50, 1e-300):  # logits / T overflowed (or T became 0): NaN, a traceback
        assert set(gen.pick_next(logits * 1e3, tiny, None, None, generator).flatten().tolist()) == {0}
        assert set(gen.pick_next(logits * 1e3, tiny, 0, 0.9, generator).flatten().tolist()) == {0}


def test_non_finite_logits_are_one_line_not_multinomials_error():
    """A checkpoint whose weights hold NaN (hash-valid: saved that way) gives NaN logits."""
    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    with pytest.raises(ValueError, match=r"^the model's next-token probabilities are not finite \(its logits hold "
                                         r"NaN or inf: are the checkpoint's weights finite\?\)$"):
        gen.pick_next(logits, 1.0, None, None, torch.Generator().manual_seed(0))


def test_a_row_stops_at_the_end_of_document():
    model = model_of(LLAMA)
    prompt = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(4))
    free = model.generate(prompt, 12, temperature=0)
    new = free[0, 3:].tolist()
    # the end of document: a token row 0 produces, and then does not repeat (were it not stopped)
    first, eod = next((i, t) for i, t in enumerate(new[:-1]) if new.index(t) == i and new[i + 1] != t)
    out = model.generate(prompt, 12, temperature=0, eod_id=eod)
    assert out[0, : 3 + first + 1].tolist() == free[0, : 3 + first + 1].tolist()
    assert (out[0, 3 + first:] == eod).all()  # the finished row repeats it
    row1 = (free[1, 3:] == eod).nonzero()
    stop = 3 + (row1[0].item() if len(row1) else 11) + 1
    assert torch.equal(out[1, :stop], free[1, :stop])
    # one row: generation ends at its end of document
    single = model.generate(prompt[:1], 12, temperature=0, eod_id=eod)
    assert single[0].tolist() == free[0, : 3 + first + 1].tolist()
    # stopped early: its own ids, not a view that keeps the whole B x (T + max_new) buffer (review)
    assert single.shape[1] < 3 + 12 and single.untyped_storage().nbytes() == single.numel() * single.element_size()


@pytest.mark.parametrize("kwargs, message", [({"temperature": -1.0}, "temperature=-1.0 must be >= 0"),
                                             ({"temperature": float("nan")}, "temperature=nan"),
                                             ({"temperature": float("inf")}, "temperature=inf must be >= 0 and finite"),
                                             ({"top_k": -3}, "top_k=-3 must be >= 0"),
                                             ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
                                             ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]")])
def test_bad_sampling_settings_are_refused(kwargs, message):
    model = model_of(GPT2)
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3, **kwargs)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_new_tokens=-1 must be >= 0"):  # torch's negative-size error (review)
        model.generate(torch.zeros(1, 2, dtype=torch.long), -1)


def test_the_cache_holds_the_prompt_and_the_new_tokens_not_the_whole_context(monkeypatch):
    """KVCache was sized to seq_length whatever the request: 32 GiB a sample at 128k context for a
    few new tokens. It holds the prompt's last window and the new tokens now, with the same tokens out."""
    model = model_of(dataclasses.replace(GPT2, seq_length=4096))
    caches, real = [], gen.KVCache

    def recording(num_layers, seq_length):
        caches.append(real(num_layers, seq_length))
        return caches[-1]
    monkeypatch.setattr(gen, "KVCache", recording)
    idx = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = gen.generate(model, idx, 3, temperature=0)
    assert [tuple(keys.shape) for keys in caches[0].keys] == [(2, 4, 8, 16)] * 2
    assert torch.equal(cached, gen.generate(model, idx, 3, temperature=0, use_cache=False))
