"""Tokens/s of one model and batch through megaframe, a hand-written PyTorch loop and HF transformers.

usage: python tools/bench.py [--arch gpt2|llama] [--steps 20] [--warmup 3] [OVERRIDE ...]

All three train the same shape on the same demo-corpus batches with AdamW, gradient accumulation
and clipping, in this one process:
  megaframe    the real path: DeepSpeed engine (tp=1, ZeRO-0) driven by megaframe's Trainer
  pytorch      megaframe's GPT module with torch.optim.AdamW in a plain loop (no DeepSpeed)
  transformers GPT2LMHeadModel / LlamaForCausalLM of the same shape (SDPA attention)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import megaframe  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))

SHAPE = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.ffn_hidden_size=1024",
         "model.seq_length=128", "parallel.micro_batch_size=8", "parallel.global_batch_size=16",
         "train.eval_interval=0", "logging.wandb.mode=disabled", "logging.progress_bar=false", "optim.warmup_steps=2"]


def _timed(step_fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step_fn()
    start = time.perf_counter()
    for _ in range(steps):
        step_fn()
    return time.perf_counter() - start


def bench_megaframe(cfg, layout, steps: int, warmup: int) -> float:
    import tempfile

    from megaframe.engine.trainer import Trainer

    trainer = Trainer(cfg, layout, Path(tempfile.mkdtemp(prefix="megaframe-bench-")))

    seconds = _timed(trainer.train_step, warmup, steps)
    trainer.close()
    return seconds


def _plain_loop(model, cfg, data, layout, forward, steps: int, warmup: int) -> float:
    """The loop a user would write: accumulate micro-batches, clip, AdamW step."""
    import torch

    from megaframe.data import micro_batches
    from megaframe.engine.trainer import decay_param_groups

    o = cfg.optim
    optimizer = torch.optim.AdamW(decay_param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    state = {"step": 0}

    def step():
        batches = micro_batches(data.train, state["step"], layout.global_batch_size, layout.micro_batch_size, 0, 1,
                                cfg.train.seed)
        for inputs, targets in batches:
            (forward(inputs, targets) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
    return _timed(step, warmup, steps)


def bench_pytorch(cfg, layout, data, dims, steps: int, warmup: int) -> float:
    from megaframe.model.factory import build_model
    from megaframe.parallel.state import ParallelState

    model = build_model(dims, ParallelState(1, 1, 1, rank=0), cfg.train.seed).train()
    return _plain_loop(model, cfg, data, layout, model, steps, warmup)


def bench_transformers(cfg, layout, data, dims, steps: int, warmup: int) -> float:
    import torch.nn.functional as F
    import transformers

    if cfg.model.arch == "llama":
        hf_cfg = transformers.LlamaConfig(
            vocab_size=dims.padded_vocab_size, hidden_size=dims.hidden_size, intermediate_size=dims.ffn_hidden_size,
            num_hidden_layers=dims.num_layers, num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
            max_position_embeddings=dims.seq_length, rms_norm_eps=dims.norm_eps, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.GPT2Config(
            vocab_size=dims.padded_vocab_size, n_positions=dims.seq_length, n_embd=dims.hidden_size,
            n_layer=dims.num_layers, n_head=dims.num_heads, n_inner=dims.ffn_hidden_size, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(hf_cfg)
    model.config._attn_implementation = "sdpa"
    model.train()

    def forward(inputs, targets):
        logits = model(input_ids=inputs).logits[..., : dims.vocab_size]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return _plain_loop(model, cfg, data, layout, forward, steps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="extra megaframe config overrides")
    args = parser.parse_args()
    import torch

    from megaframe.cli import compose
    from megaframe.config.validate import ConfigError, validate
    from megaframe.engine.data_setup import build_data
    from megaframe.model.factory import resolve_dims

    try:
        cfg, _ = compose([f"model={'llama' if args.arch == 'llama' else 'gpt'}_tiny", *SHAPE, *args.overrides,
                          f"train.max_steps={args.steps + args.warmup}"])
        layout = validate(cfg, 1)
    except ConfigError as err:
        print(f"bench: error: {err}", file=sys.stderr)
        sys.exit(2)
    data = build_data(cfg.data, cfg.model.seq_length)
    dims = resolve_dims(cfg.model, data.vocab_size)
    tokens = args.steps * layout.global_batch_size * cfg.model.seq_length
    results = {}
    for name, run in (("megaframe", lambda: bench_megaframe(cfg, layout, args.steps, args.warmup)),
                      ("pytorch", lambda: bench_pytorch(cfg, layout, data, dims, args.steps, args.warmup)),
                      ("transformers", lambda: bench_transformers(cfg, layout, data, dims, args.steps, args.warmup))):
        torch.manual_seed(cfg.train.seed)
        results[name] = tokens / run()
    print(f"\n{args.arch}: {dims.num_layers} layers, hidden {dims.hidden_size}, ffn {dims.ffn_hidden_size}, "
          f"seq {dims.seq_length}, global batch {layout.global_batch_size} (micro {layout.micro_batch_size}), "
          f"{args.steps} timed steps after {args.warmup}, torch threads {torch.get_num_threads()}")
    print("| framework | tokens/s | megaframe / this |")
    print("|---|---|---|")
    for name, rate in results.items():
        print(f"| {name} | {rate:,.0f} | {results['megaframe'] / rate:.3f} |")


if __name__ == "__main__":
    main()
