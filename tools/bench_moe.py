#!/usr/bin/env python
"""Expert parallelism on this machine: tokens/s of model=moe_tiny on the same 2 ranks and global
batch, dp=2 with every rank holding all 8 experts (ep=1) against dp=2 with 4 experts each (ep=2,
tokens exchanged by all-to-all), dropless and with capacity factor 1.25. The median over the steps
after warm-up, each layout run `--repeats` times, interleaved.

    OMP_NUM_THREADS=1 python tools/bench_moe.py [--steps 30] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"dp=2 ep=1": ["parallel.dp=2"], "dp=2 ep=2": ["parallel.dp=2", "parallel.ep=2"],
           "dp=2 ep=1 capacity 1.25": ["parallel.dp=2", "model.moe.capacity_factor=1.25"],
           "dp=2 ep=2 capacity 1.25": ["parallel.dp=2", "parallel.ep=2", "model.moe.capacity_factor=1.25"]}


def tokens_per_s(layout: list[str], steps: int) -> float:
    run_dir = Path(tempfile.mkdtemp())
    args = ["model=moe_tiny", "parallel.micro_batch_size=4", "parallel.global_batch_size=16",
            f"train.max_steps={steps}", "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0",
            "logging.wandb.mode=disabled", "logging.progress_bar=false", *layout, f"hydra.run.dir={run_dir}"]
    subprocess.run([sys.executable, "-m", "megaframe.train", *args], cwd=REPO, check=True, capture_output=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][3:]  # the first steps warm up
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(args.repeats):
        for name, layout in LAYOUTS.items():
            results[name].append(tokens_per_s(layout, args.steps))
    for name, rates in results.items():
        print(f"{name:26s} tokens/s: {', '.join(f'{r:,.0f}' for r in rates)}")


if __name__ == "__main__":
    main()
