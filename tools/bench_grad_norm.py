"""Time the ZeRO-0 gradient norm: fp64 chunks (megaframe/parallel/grad_norm.py) against the fp32
dot product it replaced, on the default model and on one layer of the Llama-2-7B shape.

    OMP_NUM_THREADS=1 python tools/bench_grad_norm.py      # about a minute on a 2-core CPU
"""
from __future__ import annotations

import time

import torch

from megaframe.config.compose import compose
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.grad_norm import grad_norm
from megaframe.parallel.state import ParallelState

SHAPES = {"default gpt_tiny": [], "llama2_7b, 1 layer": ["recipe=llama2_7b", "model.num_layers=1"]}


def fp32_dot_norm(model: torch.nn.Module) -> float:
    """The norm as it was computed before: fp32 dot products, summed in fp64."""
    grads = [p.grad.reshape(-1) for p in model.parameters()]
    return torch.stack([torch.dot(g, g) for g in grads]).double().sum().sqrt().item()


def best_of(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ps = ParallelState(ParallelDims(), rank=0)
    for label, overrides in SHAPES.items():
        cfg, _ = compose(overrides)
        dims = resolve_dims(cfg.model, cfg.model.vocab_size or 257)
        model = build_model(dims, ps, seed=0)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        n = sum(p.numel() for p in model.parameters())
        before, now = best_of(lambda: fp32_dot_norm(model)), best_of(lambda: grad_norm(model, ps))
        print(f"{label}: {n / 1e6:.2f}M parameters, fp32 dot {before * 1e3:.2f} ms, fp64 chunks {now * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
