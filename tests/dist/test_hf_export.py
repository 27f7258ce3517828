"""HF export parity: a tiny Llama and GPT-2 trained a few steps through the real trainer, exported
with `to-hf`, give through `transformers` the logits the trained megaframe model gives (fp32)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import REPO, TINY, assert_ok, cli_env, console_script
from megaframe.convert.cli import export_hf
from tests.support.parity import FLAVOURS
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
BYTE_VOCAB = 257  # the demo corpus is byte-tokenized: padded to 384 rows here (a GPU's padding), which the export drops


def train_and_snapshot(rank: int, world: int, runs: dict, ids: torch.Tensor) -> dict:
    """Train each flavour (the trainer saves a layout-free checkpoint at the end); return its logits."""
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer
    from megaframe.model.factory import build_model
    from megaframe.model.full_state import full_state_dict

    out = {}
    for flavour, run_dir in runs.items():
        cfg, _ = compose([*TINY, *FLAVOURS[flavour], "train.max_steps=4", "optim.lr=3e-3",
                           "model.make_vocab_size_divisible_by=128"])
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
            trainer.fit()
        module = trainer.backend.module.eval()
        full = full_state_dict(module)
        initial = full_state_dict(build_model(trainer.dims, trainer.ps, cfg.train.seed))
        with torch.no_grad():
            out[flavour] = {"logits": module.logits(ids), "padded_rows": module.embed.tok.weight.shape[0],
                            "trained": any(not torch.equal(full[k], initial[k]) for k in full)}
    return out


def test_trained_models_exported_to_hf_give_megaframe_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from megaframe.data.tokenizer import ByteTokenizer

    ids = torch.randint(0, BYTE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    runs = {flavour: tmp_path / flavour for flavour in ("llama", "gpt2")}
    [trained] = run_ranks(train_and_snapshot, 1, tmp_path, runs=runs, ids=ids)

    for flavour, run_dir in runs.items():
        assert trained[flavour]["trained"] and trained[flavour]["padded_rows"] == 384
        out = tmp_path / f"hf-{flavour}"
        if flavour == "llama":  # the tool as a user types it (one process start is enough)
            result = subprocess.run([console_script("megaframe-convert"), "to-hf", str(run_dir / "checkpoints"),
                                     str(out)], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
            assert_ok(result)
            assert "LlamaForCausalLM" in result.stdout
        else:
            export_hf(run_dir / "checkpoints", out)  # a run's checkpoints/: follows `latest`
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[flavour]
        assert hf.config.vocab_size == BYTE_VOCAB  # padded rows dropped
        with torch.no_grad():
            got = hf(ids).logits
        want = trained[flavour]["logits"]
        assert got.shape == want.shape == (2, 32, BYTE_VOCAB)
        diff = (got - want).abs().max().item()
        print(f"export parity {flavour}: max |transformers - megaframe| = {diff:.3g}")
        # as in test_hf_import: two implementations, fp32 rounding ~1e-6 on logits of O(1-10)
        assert diff < 1e-4, f"{flavour}: max |transformers - megaframe| = {diff}"

        # the byte run's export carries a byte-level tokenizer with megaframe's ids, and generates
        tokenizer, text = AutoTokenizer.from_pretrained(out), "To be, or not to be: é"
        assert tokenizer.encode(text) == ByteTokenizer().encode(text)
        assert hf.config.eos_token_id == ByteTokenizer.eod_id
        prompt = tokenizer(text, return_tensors="pt").input_ids
        assert hf.generate(prompt, do_sample=False).shape[1] <= 32  # stops at the context (model.seq_length=32)
        generated = pipeline("text-generation", model=str(out))(text, max_new_tokens=4, do_sample=False)
        assert generated[0]["generated_text"].startswith(text)
