"""Tokens/s of one model and batch through megaframe, a hand-written PyTorch loop and HF transformers.

usage: python tools/bench.py [--arch gpt2|llama] [--steps 10] [--repeats 5] [--warmup 3] [--no-compile]
                             [OVERRIDE ...]

All train the same shape on the same demo-corpus batches with AdamW, gradient accumulation and
clipping, in this one process:
  megaframe    the real path: DeepSpeed engine (tp=1, ZeRO-0) driven by megaframe's Trainer
  megaframe+compile  the same with train.compile=true (blocks compiled by inductor; the compile
               happens in the warm-up steps, which are not timed); --no-compile leaves it out
  pytorch      megaframe's GPT module with torch.optim.AdamW in a plain loop (no DeepSpeed)
  transformers GPT2LMHeadModel / LlamaForCausalLM of the same shape (SDPA attention)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
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


def timed(step_fn, steps: int) -> float:
    """Seconds for `steps` calls of step_fn."""
    start = time.perf_counter()
    for _ in range(steps):
        step_fn()
    return time.perf_counter() - start


def setup(arch: str, overrides: list[str], max_steps: int):
    """(cfg, layout, data, dims) of the bench shape in flavour `arch`; raises ConfigError."""
    from megaframe.config.compose import compose
    from megaframe.config.validate import validate
    from megaframe.engine.data_setup import build_data
    from megaframe.model.factory import resolve_dims

    cfg, _ = compose([f"model={'llama' if arch == 'llama' else 'gpt'}_tiny", *SHAPE, *overrides,
                      f"train.max_steps={max_steps}"])
    layout = validate(cfg, 1)
    data = build_data(cfg.data, cfg.model.seq_length)
    return cfg, layout, data, resolve_dims(cfg.model, data.vocab_size)


def megaframe_path(cfg, layout):
    """(step, close) of megaframe's real path: the Trainer on a DeepSpeed engine."""
    import tempfile

    from megaframe.engine.trainer import Trainer

    trainer = Trainer(cfg, layout, Path(tempfile.mkdtemp(prefix="megaframe-bench-")))
    return trainer.train_step, trainer.close


def adamw(model, cfg, **extra):
    """torch.optim.AdamW over megaframe's weight-decay groups with the config's hyperparameters."""
    import torch

    from megaframe.backends.deepspeed.engine import decay_param_groups

    o = cfg.optim
    return torch.optim.AdamW(decay_param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             **extra)


def _plain_loop(model, cfg, data, layout, forward):
    """(step, close) of the loop a user would write: accumulate micro-batches, clip, AdamW step."""
    import torch

    from megaframe.data import micro_batches

    o = cfg.optim
    optimizer = adamw(model, cfg)
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
    return step, lambda: None


def pytorch_path(cfg, layout, data, dims):
    from megaframe.model.factory import build_model
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    model = build_model(dims, ParallelState(ParallelDims(), rank=0), cfg.train.seed).train()
    return _plain_loop(model, cfg, data, layout, model)


def transformers_path(cfg, layout, data, dims):
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
    return _plain_loop(model, cfg, data, layout, forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per path and round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="leave out the megaframe+compile path")
    parser.add_argument("overrides", nargs="*", help="extra megaframe config overrides")
    args = parser.parse_args()
    import torch

    from megaframe.config.validate import ConfigError

    try:
        cfg, layout, data, dims = setup(args.arch, args.overrides, args.repeats * args.steps + args.warmup)
    except ConfigError as err:
        print(f"bench: error: {err}", file=sys.stderr)
        sys.exit(2)
    tokens = args.steps * layout.global_batch_size * cfg.model.seq_length
    compiled_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True))
    builders = {"megaframe": lambda: megaframe_path(cfg, layout),
                "megaframe+compile": lambda: megaframe_path(compiled_cfg, layout),
                "pytorch": lambda: pytorch_path(cfg, layout, data, dims),
                "transformers": lambda: transformers_path(cfg, layout, data, dims)}
    if args.no_compile:
        del builders["megaframe+compile"]
    paths = {}
    for name, build in builders.items():
        torch.manual_seed(cfg.train.seed)
        paths[name] = build()
        timed(paths[name][0], args.warmup)  # warm-up
    # Rounds interleave the paths, so a slow spell of a shared machine hits all of them; the
    # ratios are taken within each round (paths timed seconds apart), then their median.
    rates: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, (step, _close) in paths.items():
            rates[name].append(tokens / timed(step, args.steps))
    for _step, close in paths.values():
        close()
    print(f"\n{args.arch}: {dims.num_layers} layers, hidden {dims.hidden_size}, ffn {dims.ffn_hidden_size}, "
          f"seq {dims.seq_length}, global batch {layout.global_batch_size} (micro {layout.micro_batch_size}), "
          f"{args.repeats} interleaved rounds of {args.steps} timed steps after {args.warmup} warm-up steps, "
          f"torch threads {torch.get_num_threads()}")
    references = [name for name in ("megaframe", "megaframe+compile") if name in rates]
    print("| framework | tokens/s (median) | rounds min-max | "
          + " | ".join(f"{ref} / this (median of rounds, range)" for ref in references) + " |")
    print("|---" * (3 + len(references)) + "|")
    for name, values in rates.items():
        cells = []
        for ref in references:
            ratios = [r / v for r, v in zip(rates[ref], values)]
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"| {name} | {statistics.median(values):,.0f} | {min(values):,.0f}-{max(values):,.0f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
