"""Where a training step's CPU time goes: torch.profiler over the plain-loop paths of tools/bench.py.

usage: python tools/profile_step.py [--arch gpt2|llama] [--steps 3] [--warmup 3] [--rows 20]

Profiles megaframe's GPT module and transformers' model of the same shape, each in the
hand-written loop of tools/bench.py, and prints the operators by self CPU time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (tools/bench.py: the shape and the paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    cfg, layout, data, dims = bench.setup(args.arch, [], max_steps=100)
    for name, build in (("pytorch (megaframe's module)", bench.pytorch_path),
                        ("transformers", bench.transformers_path)):
        step, _ = build(cfg, layout, data, dims)
        bench.timed(step, args.warmup)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        print(f"===== {name}: {args.steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
