#!/usr/bin/env python
"""Context parallelism on this machine: tokens/s of cp=2 against dp=2 (the same 2 ranks, the same
global batch), and the bytes one rank saves for backward in one micro-batch at cp=1 and cp=2.

    OMP_NUM_THREADS=1 python -m tools.bench_context [--seq 2048] [--steps 8]
"""
from __future__ import annotations

if not __package__:  # started as a file: tests.support is importable from the repository root only
    raise SystemExit("run it from the repository root as: python -m tools.bench_context")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model=llama_tiny", "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=352"]


def tokens_per_s(layout: list[str], seq: int, steps: int) -> float:
    run_dir = Path(tempfile.mkdtemp())
    args = [*MODEL, f"model.seq_length={seq}", "parallel.micro_batch_size=1", "parallel.global_batch_size=2",
            f"train.max_steps={steps}", "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0",
            "logging.wandb.mode=disabled", "logging.progress_bar=false", *layout, f"hydra.run.dir={run_dir}"]
    subprocess.run([sys.executable, "-m", "megaframe.train", *args], cwd=REPO, check=True, capture_output=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][2:]  # the first steps warm up
    return statistics.median(rates)


def saved_bytes(rank: int, world: int, seq: int, cp_impl: str) -> int:
    """Bytes autograd keeps for backward over one micro-batch's forward on this rank."""
    import torch

    from megaframe.config.compose import compose
    from megaframe.model.factory import build_model, resolve_dims
    from megaframe.parallel.context import zigzag_shard
    from megaframe.parallel.dims import ParallelDims
    from megaframe.parallel.state import ParallelState

    cfg, _ = compose([*MODEL, f"model.seq_length={seq}"])
    ps = ParallelState.build(ParallelDims(cp=world))
    model = build_model(resolve_dims(cfg.model, 257), ps, seed=0, cp_impl=cp_impl)
    tokens = torch.randint(0, 257, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if world > 1:
        inputs, targets = zigzag_shard(inputs, world, rank), zigzag_shard(targets, world, rank)
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()  # a storage kept by several ops counts once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs, targets)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    loss.backward()
    return sum(n for ptr, n in seen.items() if ptr not in parameters)


def main() -> None:
    from tests.support.ranks import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    for name, layout in (("dp=2", ["parallel.dp=2"]), ("cp=2 ring", ["parallel.cp=2"]),
                         ("cp=2 ulysses", ["parallel.cp=2", "parallel.cp_impl=ulysses"])):
        print(f"{name}: {tokens_per_s(layout, args.seq, args.steps):,.0f} tokens/s (median of steps 3-{args.steps})",
              flush=True)
    for world, impl in ((1, "ring"), (2, "ring"), (2, "ulysses")):
        per_rank = run_ranks(saved_bytes, world, Path(tempfile.mkdtemp()), seq=args.seq, cp_impl=impl)
        label = "cp=1" if world == 1 else f"cp=2 {impl}"
        print(f"{label}: saved for backward per rank {[f'{b / 2**20:.1f} MiB' for b in per_rank]}", flush=True)


if __name__ == "__main__":
    main()
