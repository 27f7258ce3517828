"""Tokens/s of one model and batch through megaframe, a hand-written PyTorch loop and HF transformers.

usage: python tools/bench.py [--arch gpt2|llama] [--steps 10] [--repeats 5] [--warmup 3] [--no-compile]
                             [--compile-only] [--device cpu|cuda] [--shape tiny|nanogpt|xl|llama8b] [--precision P]
                             [--fp8-recipe R] [--optim adamw|muon] [--document-mask] [--cpu-time] [OVERRIDE ...]
       python tools/bench.py --startup [--repeats 5]

--shape nanogpt is nanoGPT's CPU recipe (Tiny Shakespeare's shape: 4 layers, hidden 128, seq 64,
batch 12, no bias, erf GELU; gpt2 only). --startup times launch to the end of the first step:
megaframe-train at the built-in default against tools/plain_gpt.py of the same shape.

--device cuda --shape xl is the GPU benchmark: GPT-3 XL's shape (24 layers, hidden 2048, 16 heads,
seq 2048, about 1.3B parameters) in bf16 at ZeRO-1; the plain loop then runs in bf16 autocast with
torch's fused AdamW and torch.compile, transformers in bf16 autocast. On CUDA the paths run one
after the other (three 1.3B models with optimizer states do not fit on one GPU together), and the
table adds TFLOP/s per device, MFU against the dense peak of the run's precision, and each path's
peak memory beside the planner's estimate for megaframe. (Written on a CPU-only machine: the CUDA
mode has not run yet.)

All train the same shape on the same demo-corpus batches with AdamW, gradient accumulation and
clipping, in this one process:
  megaframe    the real path: megaframe's Trainer at tp=1, ZeRO-0; in fp32 on one process that is
               the plain engine (backends/plain/: DeepSpeed's step, DeepSpeed not imported),
               otherwise DeepSpeed's engine (backend.plain_one_process=false forces it)
  megaframe+compile  the same with train.compile=true and train.compile_scope=model (the whole
               forward as one graph, as pytorch+compile; --compile-scope blocks for the per-block
               graphs); the compile happens in the warm-up steps, which are not timed; --no-compile
               leaves it out
  pytorch      megaframe's GPT module with torch.optim.AdamW in a plain loop (no DeepSpeed)
  pytorch+compile  the same loop over torch.compile(model) (CPU; on CUDA the pytorch row is compiled)
  transformers GPT2LMHeadModel / LlamaForCausalLM of the same shape (SDPA attention)
  nanogpt loop nanoGPT's train.py loop over megaframe's GPT module, vocabulary unpadded
  nanogpt model  the same loop over tools/plain_gpt.py's module (nanoGPT's: q, k, v in one matmul)

--shape llama8b is four layers of Llama-3-8B's shape (hidden 4096, 32 heads, 8 kv heads, ffn 14336,
seq 8192) in bf16 at ZeRO-1, --arch llama only: the GPU shape where fp8's larger matmuls show.

A variant of megaframe's run, timed against its baseline in the same rounds (megaframe's rows only:
the plain loops and transformers run neither fp8 nor Muon nor document masks):
  --precision fp8 [--fp8-recipe tensorwise|rowwise|rowwise_with_gw_hp|mxfp8]  against precision=bf16
  --optim muon                                                                 against optim=adamw
  --document-mask (data.document_mask=true)                                    against no mask
The baseline rows are named by what they change back, e.g. "megaframe (bf16)"; the line under the
table gives the variant's step time over the baseline's. --precision fp32|bf16|fp16 alone only sets
the precision of every path (the shape's own by default).

--cpu-time (CPU only) times each path by this process's CPU seconds instead of the wall clock: on a
machine others share, the work each step takes rather than the share of the cores it was given
(with OMP_NUM_THREADS=1 one core's seconds; with more threads their seconds add up).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
try:
    import megaframe  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))

COMMON = ["train.eval_interval=0", "train.save_interval=0", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "optim.warmup_steps=2", "plan.check=false"]
SHAPES = {
    "tiny": ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.ffn_hidden_size=1024",
             "model.seq_length=128", "parallel.micro_batch_size=8", "parallel.global_batch_size=16"],
    # GPT-3 XL (Brown et al. 2020, table 2.1); ffn 4h for gpt2, SwiGLU's 8h/3 rounded for llama
    # nanoGPT's CPU recipe (README, "I only have a macbook"): 4 layers, 4 heads, hidden 128, seq 64,
    # batch 12, no bias, no dropout, AdamW 1e-3 with betas (0.9, 0.99), cosine to 1e-4
    "nanogpt": ["model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=4",
                "model.ffn_hidden_size=512", "model.seq_length=64", "model.bias=false", "model.dropout=0.0",
                "parallel.micro_batch_size=12", "parallel.global_batch_size=12", "optim.lr=1e-3", "optim.min_lr=1e-4",
                "optim.betas=[0.9,0.99]", "model.activation=gelu_exact"],
    "xl": ["model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=2048",
           "parallel.micro_batch_size=4", "parallel.global_batch_size=8", "precision=bf16", "zero=stage1"],
    # Llama-3-8B's layer (Grattafiori et al. 2024, table 3) at its 8,192 context, four of them: what
    # fp8 speeds up in an 8B model, on one GPU with AdamW's states
    "llama8b": ["model.num_layers=4", "model.hidden_size=4096", "model.num_attention_heads=32", "model.num_kv_heads=8",
                "model.ffn_hidden_size=14336", "model.seq_length=8192", "model.rope_theta=500000.0",
                "parallel.micro_batch_size=1", "parallel.global_batch_size=2", "precision=bf16", "zero=stage1"],
}
LLAMA_ONLY = {"llama8b"}  # shapes with grouped-query attention and SwiGLU widths
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")  # precision.fp8.recipe


def variant_overrides(precision, fp8_recipe, optim, document_mask) -> tuple[list[str], list[str], str]:
    """(overrides of the run asked for, overrides of its baseline, the baseline's label) from bench's
    options; the label is empty when no variant is asked (no baseline rows then). A bench option's
    mistake raises ValueError with the message."""
    if fp8_recipe and precision != "fp8":
        raise ValueError(f"--fp8-recipe {fp8_recipe} is read only with --precision fp8")
    asked = [f"precision={precision}"] if precision else []
    asked += [f"precision.fp8.recipe={fp8_recipe}"] if fp8_recipe else []
    asked += [f"optim={optim}"] if optim else []
    asked += ["data.document_mask=true"] if document_mask else []
    if precision == "fp8":
        baseline, labels = ["precision=bf16"], ["bf16"]  # fp8's matmuls against the bf16 run they replace
    else:
        baseline, labels = asked[:1] if precision else [], []
    if optim == "muon":
        labels.append("adamw")  # optim=adamw is the default group
    elif optim:
        baseline.append(f"optim={optim}")
    if document_mask:
        labels.append("no document mask")
    return asked, baseline, ", ".join(labels)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # a GPU step is only done when its kernels are


def timed(step_fn, steps: int, clock=time.perf_counter) -> float:
    """Seconds for `steps` calls of step_fn, by `clock` (the wall clock; time.process_time: --cpu-time)."""
    _synchronize()
    start = clock()
    for _ in range(steps):
        step_fn()
    _synchronize()
    return clock() - start


def setup(arch: str, overrides: list[str], max_steps: int, shape: str = "tiny", device: str = "cpu"):
    """(cfg, layout, data, dims) of the bench shape in flavour `arch`; raises ConfigError."""
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.data_setup import build_data
    from megaframe.model.factory import resolve_dims

    cfg, _ = compose([f"model={'llama' if arch == 'llama' else 'gpt'}_tiny", *SHAPES[shape], *COMMON, *overrides,
                      f"train.max_steps={max_steps}"])
    # megaframe-train's checks: the engine's and the optimizer's layout rules and the device's
    # (Muon on DeepSpeed's ZeRO, fp8 below SM 8.9) refused here in one line, not in the Trainer
    layout = validate_for_engine(cfg, 1)
    data = build_data(cfg.data, cfg.model.seq_length)
    return cfg, layout, data, resolve_dims(cfg.model, data.vocab_size, device_type=device)


def megaframe_path(cfg, layout):
    """(step, close) of megaframe's real path: the Trainer on the engine a run of this config gets."""
    import shutil
    import tempfile

    from megaframe.training.trainer import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix="megaframe-bench-"))
    trainer = Trainer(cfg, layout, run_dir)

    def close() -> None:  # the run folder goes too: every bench run used to leave one in the temp folder
        try:
            trainer.close()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    return trainer.train_step, close


def adamw(model, cfg, **extra):
    """torch.optim.AdamW over megaframe's weight-decay groups with the config's hyperparameters."""
    import torch

    from megaframe.backends.common import decay_param_groups

    o = cfg.optim
    return torch.optim.AdamW(decay_param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             **extra)


def _plain_loop(model, cfg, data, layout, forward, device: str = "cpu"):
    """(step, close) of the loop a user would write: accumulate micro-batches, clip, AdamW step.
    On CUDA: bf16 autocast over fp32 weights (when the config trains in bf16) and fused AdamW."""
    import contextlib

    import torch

    from megaframe.data import micro_batches

    o = cfg.optim
    cuda = device == "cuda"
    optimizer = adamw(model, cfg, fused=True) if cuda else adamw(model, cfg)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda and cfg.precision.dtype == "bf16" \
        else contextlib.nullcontext
    state = {"step": 0}

    def step():
        batches = micro_batches(data.train, state["step"], layout.global_batch_size, layout.micro_batch_size, 0, 1,
                                cfg.train.seed)
        for inputs, targets in batches:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with autocast():
                loss = forward(inputs, targets) / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
    return step, lambda: None


def pytorch_path(cfg, layout, data, dims, device: str = "cpu", compiled: bool = False):
    import torch

    from megaframe.model.factory import build_model
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    model = build_model(dims, ParallelState(ParallelDims(), rank=0), cfg.train.seed).train().to(device)
    # the hand-written loop's best effort on CUDA; on the CPU, compiled=True is its own row
    forward = torch.compile(model) if device == "cuda" or compiled else model
    return _plain_loop(model, cfg, data, layout, forward, device)


def nanogpt_path(cfg, layout, data, dims, device: str = "cpu", module: str = "megaframe"):
    """(step, close) of nanoGPT's train.py loop, over megaframe's GPT module (module="megaframe") or
    tools/plain_gpt.py's nanoGPT-shaped one (module="plain": one matmul for q, k and v), at the
    unpadded vocabulary (nanoGPT pads only when told to): get_batch draws windows with torch.randint from
    the token stream, the lr is set on every group each step (warm-up, then cosine to min_lr), the
    loss is read every step (its CPU recipe logs every step), then clip, AdamW as torch defaults it
    (foreach on the CPU; fused on CUDA, as nanoGPT asks) and zero_grad(set_to_none=True)."""
    import dataclasses
    import math

    import numpy as np
    import torch

    from megaframe.model.factory import build_model
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    if module == "plain":
        import plain_gpt  # tools/plain_gpt.py, beside this file

        gelu = "tanh" if dims.activation == "gelu" else "none"
        model = plain_gpt.GPT(dims.vocab_size, dims.seq_length, dims.num_layers, dims.hidden_size, dims.num_heads,
                              dims.bias, gelu).train().to(device)
    else:
        unpadded = dataclasses.replace(dims, padded_vocab_size=dims.vocab_size)
        model = build_model(unpadded, ParallelState(ParallelDims(), rank=0), cfg.train.seed).train().to(device)
    optimizer = adamw(model, cfg, fused=True) if device == "cuda" else adamw(model, cfg)
    stream = np.asarray(data.train.stream.tokens)
    o, block, batch = cfg.optim, dims.seq_length, layout.micro_batch_size
    accum = layout.global_batch_size // batch

    def get_batch():
        ix = torch.randint(len(stream) - block, (batch,))
        x = torch.stack([torch.from_numpy(stream[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(stream[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)

    def get_lr(it):
        if it < o.warmup_steps:
            return o.lr * (it + 1) / (o.warmup_steps + 1)
        ratio = min((it - o.warmup_steps) / max(cfg.train.max_steps - o.warmup_steps, 1), 1.0)
        return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)

    state = {"iter": 0, "batch": get_batch(), "loss": 0.0}

    def step():
        lr = get_lr(state["iter"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(accum):
            loss = model(*state["batch"]) / accum
            state["batch"] = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["loss"] = loss.item() * accum
        state["iter"] += 1
    return step, lambda: None


def transformers_path(cfg, layout, data, dims, device: str = "cpu"):
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
    model.train().to(device)

    def forward(inputs, targets):
        logits = model(input_ids=inputs).logits[..., : dims.vocab_size]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return _plain_loop(model, cfg, data, layout, forward, device)


def cuda_report(args, cfg, layout, dims, builders, base_label: str = "") -> None:
    """The GPU benchmark: each path built, warmed, timed and freed in turn; tokens/s, TFLOP/s per
    device, MFU against the peak of the run's precision, peak memory, and the planner's estimate."""
    import gc

    import torch

    from megaframe.plan.estimate import estimate_config
    from megaframe.tracking.flops import flops_per_token, peak_tflops

    tokens = args.steps * layout.global_batch_size * cfg.model.seq_length
    peak = peak_tflops(cfg.cluster.peak_tflops, cfg.precision.dtype, cfg.cluster.gpu)
    planned = estimate_config(cfg, layout)
    rows, all_rates = [], {}
    for name, build in builders.items():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(cfg.train.seed)
        step, close = build()
        timed(step, args.warmup)
        rates = all_rates[name] = [tokens / timed(step, args.steps) for _ in range(args.repeats)]
        peak_bytes = torch.cuda.max_memory_allocated() - before
        close()
        del step, close
        rate = statistics.median(rates)
        tflops = rate * flops_per_token(dims) / 1e12
        rows.append((name, rate, min(rates), max(rates), tflops, tflops / peak if peak else None, peak_bytes))
    print(f"\n{args.arch} on {torch.cuda.get_device_name()}: {dims.num_layers} layers, hidden {dims.hidden_size}, "
          f"heads {dims.num_heads}, seq {dims.seq_length}, global batch {layout.global_batch_size} (micro "
          f"{layout.micro_batch_size}), {cfg.precision.dtype}, ZeRO-{cfg.zero.stage}; torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; {args.repeats} rounds of {args.steps} steps after {args.warmup} warm-up")
    print(f"planner's peak for megaframe: {planned.peak / 2**30:.2f} GiB (of which {planned.reserved / 2**30:.2f} "
          f"reserved for the CUDA context and allocator)")
    print("| framework | tokens/s (median) | rounds min-max | TFLOP/s per device | MFU | peak memory GiB |")
    print("|---|---|---|---|---|---|")
    for name, rate, low, high, tflops, mfu, peak_bytes in rows:
        print(f"| {name} | {rate:,.0f} | {low:,.0f}-{high:,.0f} | {tflops:.1f} | "
              f"{'-' if mfu is None else f'{mfu:.1%}'} | {peak_bytes / 2**30:.2f} |")
    for line in variant_ratio_lines(all_rates, base_label, interleaved=False):
        print(f"{line} (medians: on CUDA the paths run one after the other)")


def megaframe_builders(cfg, layout, compile_scope: str, no_compile: bool, compile_only: bool = False) -> dict:
    """{row: build} of megaframe's rows for cfg: eager unless compile_only, then compiled unless no_compile."""
    compiled_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True,
                                                                      compile_scope=compile_scope))
    builders = {} if compile_only else {"megaframe": lambda: megaframe_path(cfg, layout)}
    if not no_compile:
        builders["megaframe+compile"] = lambda: megaframe_path(compiled_cfg, layout)
    return builders


def plain_builders(args, cfg, layout, data, dims) -> dict:
    """{row: build} of the paths megaframe is compared with: the plain PyTorch loop, transformers, nanoGPT."""
    builders = {"pytorch": lambda: pytorch_path(cfg, layout, data, dims, args.device),
                "pytorch+compile": lambda: pytorch_path(cfg, layout, data, dims, args.device, compiled=True),
                "transformers": lambda: transformers_path(cfg, layout, data, dims, args.device),
                "nanogpt loop": lambda: nanogpt_path(cfg, layout, data, dims, args.device),
                "nanogpt model": lambda: nanogpt_path(cfg, layout, data, dims, args.device, module="plain")}
    if args.arch != "gpt2":  # tools/plain_gpt.py is nanoGPT's GPT-2 model, not a Llama
        del builders["nanogpt model"]
    if args.no_compile or args.device == "cuda":  # on CUDA the pytorch row is the compiled loop already
        del builders["pytorch+compile"]
    return builders


def variant_ratio_lines(rates: dict[str, list[float]], label: str, interleaved: bool) -> list[str]:
    """Each variant row's step time over its baseline row's ("megaframe" against "megaframe (LABEL)"):
    the median of the rounds' ratios and their range when the rows were interleaved, else the ratio
    of the medians; none without a baseline (label empty)."""
    lines = []
    for name in [n for n in rates if label and f"{n} ({label})" in rates]:
        base = rates[f"{name} ({label})"]
        ratios = [b / v for v, b in zip(rates[name], base)] if interleaved \
            else [statistics.median(base) / statistics.median(rates[name])]
        spread = f" (rounds {min(ratios):.3f}-{max(ratios):.3f})" if len(ratios) > 1 else ""
        lines.append(f"step time {name} / {name} ({label}): {statistics.median(ratios):.3f}{spread}")
    return lines


def startup_report(rounds: int) -> None:
    """Launch to the end of the first step, each a fresh process: megaframe-train at the built-in
    default model against tools/plain_gpt.py of the same shape and batch, in interleaved rounds.
    Both train on the demo corpus; neither evaluates before its first step (train.eval_interval=0)."""
    import json
    import subprocess
    import tempfile

    from megaframe.config.compose import compose
    from megaframe.training.data_setup import build_data

    cfg, _ = compose([])
    m, p = cfg.model, cfg.parallel
    tokens = Path(f"{build_data(cfg.data, m.seq_length).train.stream.dataset.prefix}.bin")
    run_root = Path(tempfile.mkdtemp(prefix="megaframe-startup-"))
    plain = [sys.executable, str(REPO / "tools" / "plain_gpt.py"), str(tokens), "--layers", str(m.num_layers),
             "--hidden", str(m.hidden_size), "--heads", str(m.num_attention_heads), "--seq", str(m.seq_length),
             "--batch", str(p.micro_batch_size), "--accum", str(p.global_batch_size // p.micro_batch_size), "--bias"]

    def megaframe_run(i: int) -> float:
        run_dir = run_root / f"run-{i}"
        started = time.time()
        subprocess.run([sys.executable, "-m", "megaframe.train", "train.max_steps=2", "train.log_interval=1",
                        "train.eval_interval=0", "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}"],
                       check=True, capture_output=True, cwd=run_root)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return next(r["time"] for r in records if r.get("step") == 1 and "loss" in r) - started

    def plain_run(_: int) -> float:
        started = time.time()
        out = subprocess.run(plain, check=True, capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])["first_step_at"] - started

    times: dict[str, list[float]] = {"megaframe-train": [], "plain_gpt.py": []}
    for i in range(rounds):
        times["megaframe-train"].append(megaframe_run(i))
        times["plain_gpt.py"].append(plain_run(i))
    gaps = [a - b for a, b in zip(times["megaframe-train"], times["plain_gpt.py"])]
    print(f"\nlaunch to the end of the first step, default model ({m.num_layers} layers, hidden {m.hidden_size}, "
          f"seq {m.seq_length}, batch {p.global_batch_size}), {rounds} interleaved rounds, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| program | seconds (median) | rounds min-max |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")
    print(f"| megaframe-train - plain_gpt.py | {statistics.median(gaps):+.2f} | {min(gaps):+.2f}-{max(gaps):+.2f} |")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per path and round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="leave out the megaframe+compile path")
    parser.add_argument("--compile-only", action="store_true",
                        help="leave out megaframe's eager path (a GPU's fp8 is fast compiled only)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny", help="xl: GPT-3 XL (1.3B) in bf16, ZeRO-1")
    parser.add_argument("--compile-scope", choices=["model", "blocks"], default="model",
                        help="train.compile_scope of the megaframe+compile row (model: the whole forward, as the "
                             "compiled plain loop)")
    parser.add_argument("--startup", action="store_true",
                        help="time launch to first step instead: megaframe-train against tools/plain_gpt.py")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp8"],
                        help="precision of every path (default: the shape's); fp8: megaframe against its bf16 run")
    parser.add_argument("--fp8-recipe", choices=FP8_RECIPES, help="precision.fp8.recipe (with --precision fp8)")
    parser.add_argument("--optim", choices=["adamw", "muon"], help="muon: megaframe with optim=muon against AdamW")
    parser.add_argument("--document-mask", action="store_true",
                        help="megaframe with data.document_mask=true against the same run without it")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this process's CPU seconds, not the wall clock (CPU only): the work, on a "
                             "machine others share")
    parser.add_argument("overrides", nargs="*", help="extra megaframe config overrides")
    args = parser.parse_args(argv)
    if args.cpu_time and (args.device == "cuda" or args.startup):
        print("bench: error: --cpu-time times the host's work in this process; --device cuda and --startup are "
              "timed by the wall clock: leave --cpu-time out", file=sys.stderr)
        sys.exit(2)
    if args.no_compile and args.compile_only:
        print("bench: error: --no-compile and --compile-only leave no megaframe path; give one of them", file=sys.stderr)
        sys.exit(2)
    try:
        asked, base, base_label = variant_overrides(args.precision, args.fp8_recipe, args.optim, args.document_mask)
    except ValueError as err:
        print(f"bench: error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.shape == "nanogpt" and args.arch != "gpt2":
        print("bench: error: --shape nanogpt is nanoGPT's GPT-2 model; use --arch gpt2", file=sys.stderr)
        sys.exit(2)
    if args.shape in LLAMA_ONLY and args.arch != "llama":
        print(f"bench: error: --shape {args.shape} is a Llama shape (grouped-query attention); use --arch llama",
              file=sys.stderr)
        sys.exit(2)
    os.environ["DS_ACCELERATOR"] = args.device  # before anything imports DeepSpeed
    if args.startup:
        startup_report(args.repeats)
        return
    import torch

    from megaframe.config.validate import ConfigError

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench: error: --device cuda: torch sees no CUDA device here", file=sys.stderr)
        sys.exit(2)
    max_steps = args.repeats * args.steps + args.warmup
    try:
        cfg, layout, data, dims = setup(args.arch, [*asked, *args.overrides], max_steps, args.shape, args.device)
        # the baseline is refused as the variant is: a mistake in either stops the bench before any timing
        base_cfg, base_layout = setup(args.arch, [*base, *args.overrides], max_steps, args.shape, args.device)[:2] \
            if base_label else (None, None)
    except ConfigError as err:
        print(f"bench: error: {err}", file=sys.stderr)
        sys.exit(2)
    tokens = args.steps * layout.global_batch_size * cfg.model.seq_length
    builders = megaframe_builders(cfg, layout, args.compile_scope, args.no_compile, args.compile_only)
    if base_label:  # megaframe against megaframe: the other paths run neither fp8, Muon nor document masks
        baseline = megaframe_builders(base_cfg, base_layout, args.compile_scope, args.no_compile, args.compile_only)
        builders = {f"{name}{suffix}": build for name in builders
                    for suffix, build in (("", builders[name]), (f" ({base_label})", baseline[name]))}
        print(f"megaframe with {' '.join(asked)} against its run with {base_label} ({' '.join(base) or 'defaults'})")
    else:
        builders.update(plain_builders(args, cfg, layout, data, dims))
    if args.device == "cuda":
        cuda_report(args, cfg, layout, dims, builders, base_label)
        return
    clock = time.process_time if args.cpu_time else time.perf_counter
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
            rates[name].append(tokens / timed(step, args.steps, clock))
    for _step, close in paths.values():
        close()
    print(f"\n{args.arch}: {dims.num_layers} layers, hidden {dims.hidden_size}, ffn {dims.ffn_hidden_size}, "
          f"seq {dims.seq_length}, global batch {layout.global_batch_size} (micro {layout.micro_batch_size}), "
          f"{args.repeats} interleaved rounds of {args.steps} timed steps after {args.warmup} warm-up steps, "
          f"torch threads {torch.get_num_threads()}{', timed by CPU seconds (--cpu-time)' if args.cpu_time else ''}")
    references = [name for name in ("megaframe", "megaframe+compile") if name in rates]
    print(f"| framework | tokens/s{' of CPU time' if args.cpu_time else ''} (median) | rounds min-max | "
          + " | ".join(f"{ref} / this (median of rounds, range)" for ref in references) + " |")
    print("|---" * (3 + len(references)) + "|")
    for name, values in rates.items():
        cells = []
        for ref in references:
            ratios = [r / v for r, v in zip(rates[ref], values)]
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"| {name} | {statistics.median(values):,.0f} | {min(values):,.0f}-{max(values):,.0f} | "
              + " | ".join(cells) + " |")
    for line in variant_ratio_lines(rates, base_label, interleaved=True):
        print(line)


if __name__ == "__main__":
    main()
