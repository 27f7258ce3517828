"""One AdamW step on the bench model's parameters: torch's fused CPU kernel vs its CPU default.

The default on CPU is a Python loop over the tensors (torch picks foreach only on CUDA).

usage: python tools/bench_adamw.py [--arch gpt2|llama] [--threads 1] [--rounds 5] [--steps 10]

Why megaframe's CPU engine asks DeepSpeed for `fused=True` (megaframe/config/deepspeed.py). The
parameters are those of tools/bench.py's model (4 layers, hidden 256, ffn 1024), with random
gradients, in megaframe's weight-decay groups.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (tools/bench.py: the shape, the timer)


def optimizer(cfg, dims, fused: bool) -> torch.optim.AdamW:
    """AdamW (as tools/bench.py's plain loop builds it) over a fresh bench model with random gradients."""
    from megaframe.model.factory import build_model
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    model = build_model(dims, ParallelState(ParallelDims(), rank=0), cfg.train.seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return bench.adamw(model, cfg, **({"fused": True} if fused else {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg, _layout, _data, dims = bench.setup(args.arch, [], max_steps=100)
    paths = {"default (loop)": optimizer(cfg, dims, False), "fused": optimizer(cfg, dims, True)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for opt in paths.values():
        opt.step()  # creates the moments
    for _ in range(args.rounds):  # interleaved, so a slow spell of the machine hits both
        for name, opt in paths.items():
            times[name].append(bench.timed(opt.step, args.steps) / args.steps * 1e3)
    params = [p for group in paths["fused"].param_groups for p in group["params"]]
    print(f"{args.arch}: {sum(p.numel() for p in params):,} parameters in {len(params)} tensors, "
          f"{args.threads} thread(s)")
    for name, values in times.items():
        print(f"{name:18s} {statistics.median(values):7.1f} ms per step (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
