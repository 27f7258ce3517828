"""Seconds to generate new tokens with GPT.generate's key/value cache against recomputing the whole
context for every token (use_cache=False, nanoGPT's sample.py loop), on the same model and prompt.

usage: python tools/bench_sample.py [--arch gpt2|llama] [--layers 4] [--hidden 512] [--heads 8]
                                    [--seq-length 1024] [--prompt 16] [--new 512] [--repeats 1]
                                    [--device cpu|cuda] [--checkpoint CKPT]

The default is the acceptance shape of issue 51: a 4-layer, hidden-512, seq_length-1024 model
(GPT-2 flavour, byte vocabulary), 512 new tokens after a 16-token prompt, greedy. The model is
randomly initialised (the cost does not depend on the weights) unless --checkpoint names one.
Both paths must give the same tokens; the tool says so, prints both times (the best of --repeats;
wall clock and this process's CPU seconds), the speed-up and the load average (the machine may be
shared), and exits 1 if the tokens differ.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def build(args):
    """(model, vocab) at the asked shape, or the checkpoint's."""
    import torch

    from megaframe.config.schema import ModelConfig
    from megaframe.load import load_model
    from megaframe.model.factory import build_model, resolve_dims
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    if args.checkpoint:
        model = load_model(args.checkpoint, args.device)
        return model, model.dims.vocab_size
    llama = {"arch": "llama", "norm": "rmsnorm", "activation": "swiglu", "position_embedding": "rope",
             "tie_embeddings": False, "bias": False, "num_kv_heads": args.heads // 2}
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq_length, **(llama if args.arch == "llama" else {}))
    dims = resolve_dims(cfg, 257, device_type=torch.device(args.device).type)
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=0).to(args.device).eval()
    return model, 257


def timed(model, prompt, new: int, use_cache: bool, repeats: int):
    """(best wall seconds, best CPU seconds of this process, tokens) of greedy generation. On a
    shared CPU the CPU seconds are the steadier figure: the wall clock counts the others' turns."""
    import torch

    best, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        if prompt.device.type == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        out = model.generate(prompt, new, temperature=0, use_cache=use_cache)
        if prompt.device.type == "cuda":
            torch.cuda.synchronize()
        best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - start_cpu)
    return best, best_cpu, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=512, help="tokens to generate")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint", help="a megaframe checkpoint instead of a random model")
    args = parser.parse_args(argv)
    import torch

    model, vocab = build(args)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    model.generate(prompt, 4, temperature=0)  # warm-up: first-call allocations out of the timing
    model.generate(prompt, 4, temperature=0, use_cache=False)
    load = os.getloadavg()[0]
    cached, cached_cpu, with_cache = timed(model, prompt, args.new, True, args.repeats)
    full, full_cpu, without = timed(model, prompt, args.new, False, args.repeats)
    same = torch.equal(with_cache, without)
    dims = model.dims
    print(f"{args.arch if not args.checkpoint else args.checkpoint}: {dims.num_layers} layers, hidden "
          f"{dims.hidden_size}, seq_length {dims.seq_length}, {args.new} new tokens after {args.prompt} "
          f"(greedy, {args.device}, {torch.get_num_threads()} threads)")
    print(f"  KV cache:        {cached:8.2f} s wall  {cached_cpu:8.2f} s CPU  ({args.new / cached:7.1f} tokens/s)")
    print(f"  full recompute:  {full:8.2f} s wall  {full_cpu:8.2f} s CPU  ({args.new / full:7.1f} tokens/s)")
    print(f"  speed-up {full / cached:.1f}x wall, {full_cpu / cached_cpu:.1f}x CPU; same tokens: "
          f"{'yes' if same else 'NO'}; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after, on "
          f"{os.cpu_count()} CPUs")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
