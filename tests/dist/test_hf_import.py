"""HF import parity at tp=2: a random local LlamaForCausalLM / GPT2LMHeadModel, converted with
`python -m megaframe.convert from-hf`, gives megaframe logits equal to transformers' in 2 real
gloo ranks (vocabulary 300 padded to 512, so the padding and the vocab-split head are exercised)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.support.helpers import REPO, assert_ok, cli_env
from megaframe.convert.cli import import_hf
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
VOCAB, SEQ = 300, 24


def random_hf(kind: str):
    """A small randomly initialised HF model, every weight (norm gains, biases too) perturbed."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0, rms_norm_eps=1e-5))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def megaframe_logits(rank: int, world: int, checkpoints: dict, ids: torch.Tensor) -> dict:
    """In each rank: build megaframe's model at tp=world from each checkpoint, return gathered logits
    and whether gathering the shards gives back the checkpoint's tensors."""
    from megaframe.convert.cli import model_config
    from megaframe.convert.files import read_layout_free
    from megaframe.model.factory import build_model, resolve_dims
    from megaframe.model.full_state import full_state_dict, load_full_state
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    out = {}
    for kind, path in checkpoints.items():
        state, tensors = read_layout_free(path)
        cfg = model_config(state, path)
        dims = resolve_dims(cfg, cfg.vocab_size, tp=world)
        assert dims.padded_vocab_size == 512
        model = build_model(dims, ParallelState.build(ParallelDims(tp=world)), seed=7).eval()  # seed: overwritten below
        load_full_state(model, tensors)
        assert model.embed.tok.weight.shape[0] == 256  # this rank's half of the padded vocabulary
        gathered = full_state_dict(model)
        round_trip = gathered.keys() == tensors.keys() and all(torch.equal(gathered[k], tensors[k]) for k in tensors)
        with torch.no_grad():
            out[kind] = {"logits": model.logits(ids), "round_trip": round_trip}
    return out


def test_imported_models_match_transformers_at_tp2(tmp_path):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    want, checkpoints = {}, {}
    for kind in ("llama", "gpt2"):
        model = random_hf(kind)
        model.save_pretrained(tmp_path / f"hf-{kind}")
        with torch.no_grad():
            want[kind] = model(ids).logits
        checkpoints[kind] = tmp_path / f"mf-{kind}"
        if kind == "llama":  # the command as a user types it (one process start is enough)
            result = subprocess.run([sys.executable, "-m", "megaframe.convert", "from-hf", str(tmp_path / "hf-llama"),
                                     str(checkpoints[kind])], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                                    timeout=300)
            assert_ok(result)
            assert "continue pre-training with:" in result.stdout and f"train.resume={checkpoints[kind]}" in result.stdout
        else:
            import_hf(tmp_path / f"hf-{kind}", checkpoints[kind])

    ranks = run_ranks(megaframe_logits, 2, tmp_path, checkpoints=checkpoints, ids=ids)
    for kind in ("llama", "gpt2"):
        for rank, result in enumerate(ranks):
            got = result[kind]["logits"]
            assert got.shape == want[kind].shape == (2, SEQ, VOCAB)
            diff = (got - want[kind]).abs().max().item()
            print(f"import parity {kind} tp=2 rank {rank}: max |megaframe - transformers| = {diff:.3g}")
            # two implementations (SDPA vs transformers' attention, vocab-parallel vs full head) of
            # logits of O(1-10): fp32 rounding leaves ~1e-6; a wrong mapping is off by O(1)
            assert diff < 1e-4, f"{kind} rank {rank}: max |megaframe - transformers| = {diff}"
            assert result[kind]["round_trip"], f"{kind} rank {rank}: gathered shards differ from the checkpoint"
