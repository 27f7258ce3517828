"""Measure the model-state bytes DeepSpeed holds per rank for ZeRO 0-3 at dp=2 and dp=4 (bf16) and
print them next to the ZeRO paper's formulas, as the markdown table in BENCHMARKS.md.

    python -m tools.memory_table            # about 4 minutes on a 2-core CPU
"""
from __future__ import annotations

if not __package__:  # started as a file: tests.support is importable from the repository root only
    raise SystemExit("run it from the repository root as: python -m tools.memory_table")

import tempfile
from pathlib import Path


from tests.support.ranks import run_ranks  # noqa: E402  (tests/support/ranks.py: real gloo ranks)

from tests.support.memory_states import measure_zero_stages  # noqa: E402  (tests/support/memory_states.py)
from megaframe.plan.memory import model_state_bytes  # noqa: E402

FORMULA = {0: "16Ψ", 1: "4Ψ+12Ψ/N", 2: "2Ψ+14Ψ/N", 3: "16Ψ/N"}


def main() -> None:
    print("| dp | ZeRO | formula | predicted | weights | gradients | optimizer | measured | error | reduce bucket | other |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 4):
            for r in run_ranks(measure_zero_stages, world, Path(tmp), run_root=f"{tmp}/runs{world}")[0]:
                psi = r["psi"]
                predicted = model_state_bytes(psi, world, r["stage"], "bf16").device
                measured = r["weights"] + r["gradients"] + r["optimizer"]
                mib = lambda v: f"{v / 2**20:.2f} MiB"  # noqa: E731
                print(f"| {world} | {r['stage']} | {FORMULA[r['stage']]} | {mib(predicted)} | {mib(r['weights'])} | "
                      f"{mib(r['gradients'])} | {mib(r['optimizer'])} | {mib(measured)} | "
                      f"{(measured - predicted) / predicted:+.1%} | {mib(r['buckets'])} | {mib(r['other'])} |")
    print(f"\nΨ = {psi:,} parameters (whole model); bf16 weights and gradients, fp32 master + Adam m, v.")


if __name__ == "__main__":
    main()
