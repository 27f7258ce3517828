"""Measure the model-state bytes DeepSpeed holds per rank for moe_tiny (hidden 128, bf16) at dp=4, for
ep 1, 2 and 4 and ZeRO 1-3, next to the planner's figure, as the markdown table in BENCHMARKS.md.

    python -m tools.moe_memory_table        # a few minutes on a 2-core CPU
"""
from __future__ import annotations

if not __package__:  # started as a file: tests.support is importable from the repository root only
    raise SystemExit("run it from the repository root as: python -m tools.moe_memory_table")

import tempfile
from pathlib import Path


from tests.support.memory_states import measure_moe_states  # noqa: E402  (tests/support/memory_states.py)
from tests.support.ranks import run_ranks  # noqa: E402  (tests/support/ranks.py: real gloo ranks)


def main() -> None:
    cases = tuple((ep, stage) for ep in (1, 2, 4) for stage in (1, 2, 3))
    print("| ep | edp | ZeRO | planned | weights | gradients | optimizer | held | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for r in run_ranks(measure_moe_states, 4, Path(tmp), timeout=1800, run_root=f"{tmp}/runs", cases=cases)[0]:
            planned = r["planned_weights"] + r["planned_gradients"] + r["planned_optimizer"]
            held = r["weights"] + r["gradients"] + r["optimizer"]
            mib = lambda v: f"{v / 2**20:.2f} MiB"  # noqa: E731
            print(f"| {r['ep']} | {len(r['edp_ranks'])} | {r['stage']} | {mib(planned)} | {mib(r['weights'])} | "
                  f"{mib(r['gradients'])} | {mib(r['optimizer'])} | {mib(held)} | {(held - planned) / planned:+.1%} |")


if __name__ == "__main__":
    main()
