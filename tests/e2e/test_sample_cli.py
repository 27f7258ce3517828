"""megaframe-sample on checkpoints saved by multi-rank runs (tp=2 GPT-2, pp=2 Llama, FSDP2 dp=2
Llama): greedy generation gives exactly the tokens transformers' greedy generate gives on the same
checkpoint's Hugging Face export (an independent implementation), also once the window slides;
sampling is reproducible by seed; bad input is one line and exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.helpers import TINY
from tests.support.parity import FLAVOURS, train_runs
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
EOD = 256  # the byte tokenizer's end of document, which both sides stop at
SEQ = 32  # TINY's model.seq_length
# the three layouts the acceptance names, each a 2-rank run of 40 steps on a repeated sentence:
# enough for the tiny models' greedy text to follow the sentence (several distinct tokens, chosen by
# context), so that the comparison with transformers is not one of a repeated most-frequent byte
LAYOUTS = {"tp2-gpt2": [*FLAVOURS["gpt2"], "parallel.tp=2", "optim.lr=3e-3"],
           "pp2-llama": [*FLAVOURS["llama"], "parallel.pp=2", "optim.lr=1e-2"],
           "fsdp2-dp2-llama": [*FLAVOURS["llama"], "backend=fsdp2", "zero=stage3", "parallel.dp=2", "optim.lr=1e-2"]}
STEPS = ["train.max_steps=40", "train.eval_interval=0", "train.log_interval=40"]
SENTENCE = "the quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{layout: its run's checkpoints/ directory}, trained once for the module in one pair of ranks."""
    from megaframe.data import preprocess

    root = tmp_path_factory.mktemp("sample")
    (root / "sentence.txt").write_text(SENTENCE * 1000)
    preprocess([root / "sentence.txt"], root / "sentence", "byte")
    data = [f"data.path={root / 'sentence'}"]
    runs = [([*TINY, *overrides, *STEPS, *data], str(root / name)) for name, overrides in LAYOUTS.items()]
    run_ranks(train_runs, 2, root, runs=runs)
    return {name: root / name / "checkpoints" for name in LAYOUTS}


def sample(capsys, *args: str) -> list[dict]:
    """megaframe-sample ARGS --json in this process: one dict per sample."""
    from megaframe.sample_cli import main

    main([*args, "--json"])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def refusal(capsys, *args: str) -> str:
    """The one stderr line of a refused megaframe-sample ARGS (exit 2)."""
    from megaframe.sample_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy generate: the new tokens, up to and without the end of document."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=EOD, pad_token_id=EOD)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()
    return out[: out.index(EOD)] if EOD in out else out


def hf_window_argmax(hf, ids: list[int], start: int) -> list[int]:
    """For each position i >= start of ids: the argmax of transformers' logits after the SEQ
    tokens before it (nanoGPT's crop: what each token of a sliding window must be)."""
    windows = torch.tensor([ids[max(0, i - SEQ):i] for i in range(max(start, SEQ), len(ids))])
    with torch.no_grad():
        return hf(windows).logits[:, -1].argmax(-1).tolist()


def assert_cached_logits_are_transformers(checkpoint: Path, hf, ids: list[int]) -> None:
    """The cached path's logits at every step (the prompt's, then each one-token step) are
    transformers' on the whole sequence: greedy tokens alone may hide a small error (a position)."""
    from megaframe.load import load_model
    from megaframe.model.generate import KVCache, forward_cached

    model = load_model(checkpoint)
    cache, tokens = KVCache(len(model.blocks), SEQ), torch.tensor([ids])
    with torch.no_grad():
        want = hf(tokens).logits[0, 7:]
        got = [forward_cached(model, tokens[:, :8], cache)]
        got += [forward_cached(model, tokens[:, i:i + 1], cache) for i in range(8, len(ids))]
    diff = (torch.cat(got) - want).abs().max().item()
    assert diff < 1e-4, f"{checkpoint}: max |cached megaframe - transformers| = {diff}"  # as test_hf_export


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_sampling_gives_transformers_tokens_on_each_layouts_checkpoint(layout, checkpoints, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from megaframe.convert.cli import export_hf

    export_hf(checkpoints[layout], tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = list(b"the lazy")
    [got] = sample(capsys, str(checkpoints[layout]), "--prompt", "the lazy", "--temperature", "0",
                   "--max-new-tokens", str(SEQ - len(prompt)))
    assert got["prompt_ids"] == prompt
    want = hf_greedy(hf, prompt, SEQ - len(prompt))
    assert len(set(want)) >= 3, f"{layout}: the model learned too little for a telling comparison: {bytes(want)!r}"
    assert got["new_ids"] == want and got["stopped"] == (len(want) < SEQ - len(prompt))
    assert got["text"] == bytes(want).decode("utf-8", errors="replace")
    assert_cached_logits_are_transformers(checkpoints[layout], hf, prompt + want)

    # a prompt longer than the context, and generation past it: the window slides by one token
    # per token, each one what transformers' logits give after the SEQ tokens before it
    long_prompt = list(SENTENCE.encode() + b"the quick brown")
    [got] = sample(capsys, str(checkpoints[layout]), "--prompt-ids", ",".join(map(str, long_prompt)),
                   "--temperature", "0", "--max-new-tokens", "12")
    assert got["prompt_ids"] == long_prompt and len(long_prompt) > SEQ
    ids = long_prompt + got["new_ids"]
    assert got["new_ids"] == hf_window_argmax(hf, ids, len(long_prompt))[: len(got["new_ids"])]
    assert got["stopped"] or len(got["new_ids"]) == 12
    with capsys.disabled():
        print(f"{layout}: greedy {bytes(want)!r}, after the long prompt {bytes(got['new_ids'])!r}")


def test_sampling_is_reproducible_by_seed_and_bad_input_is_one_line(checkpoints, capsys, tmp_path):
    ckpt = str(checkpoints["tp2-gpt2"])
    args = [ckpt, "--prompt", "the", "--max-new-tokens", "20", "--temperature", "1.5", "--num-samples", "3"]
    first, again = sample(capsys, *args, "--seed", "7"), sample(capsys, *args, "--seed", "7")
    other = sample(capsys, *args, "--seed", "8")
    assert first == again and len(first) == 3
    assert [s["new_ids"] for s in first] != [s["new_ids"] for s in other]
    assert len({tuple(s["new_ids"]) for s in first}) > 1  # the samples of one batch differ
    assert all(0 <= t < EOD for s in first for t in s["new_ids"])
    # greedy is greedy whatever the seed, and top-k 1 is greedy
    greedy = sample(capsys, ckpt, "--prompt", "The", "--max-new-tokens", "20", "--temperature", "0", "--seed", "1")
    assert greedy == sample(capsys, ckpt, "--prompt", "The", "--max-new-tokens", "20", "--top-k", "1", "--seed", "2")

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = {
        (str(tmp_path / "nothing"),): "nothing: no such directory",
        (ckpt, "--prompt", ""): "--prompt is empty",
        (ckpt, "--prompt-file", str(empty)): "is empty",
        (ckpt, "--prompt-file", str(tmp_path / "missing.txt")): "cannot read it",
        (ckpt, "--temperature", "-0.5"): "--temperature=-0.5 must be >= 0",
        (ckpt, "--top-p", "0"): "--top-p=0.0 must be in (0, 1]",
        (ckpt, "--top-p", "1.01"): "--top-p=1.01 must be in (0, 1]",
        (ckpt, "--top-k", "-1"): "--top-k=-1 must be >= 0",
        (ckpt, "--num-samples", "0"): "--num-samples=0 must be >= 1",
        (ckpt, "--max-new-tokens", "-1"): "--max-new-tokens=-1 must be >= 0",
        (ckpt, "--prompt-ids", "72,x"): "not comma-separated integers",
        (ckpt, "--prompt-ids", "72,257"): "token id 257 is outside the vocabulary (0..256)",
        (ckpt, "--device", "cuda:99"): "--device=cuda:99",
        (ckpt, "--device", "tpu"): "--device=tpu",
        (ckpt, "--tokenizer", str(tmp_path / "no-tokenizer")): "--tokenizer=",
        (ckpt, "--prompt", "a", "--prompt-ids", "1"): "not allowed with argument",
        (ckpt, "--max-new-tokens", "many"): "invalid int value",
    }
    for args, needle in cases.items():
        assert needle in refusal(capsys, *args), args
