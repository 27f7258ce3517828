"""Measured peak memory per rank against the planner's, for the layouts of issue 15 (item 8).

    python -m tools.peak_table            # about 10 minutes on a 2-core CPU
    python -m tools.peak_table --moe      # the Mixture-of-Experts layouts (about 2 minutes)

Each layout trains 3 steps of a 13M-parameter model (4 layers, hidden 512, seq 256, micro-batch 4,
dropout 0.1, fp32, zero.reduce_bucket_size=5e6) on real gloo ranks, with and without activation
checkpointing; every rank reports the resident memory the run added at its highest (from just
before the trainer is built) and the planner's peak for its stage on this device
(tests/support/memory_peak.py). Prints a markdown table: one row per (layout, pipeline stage).

The last column adds the runtime's own memory, measured first as the peak of the same run with a
model of almost nothing (1 layer, hidden 64, micro-batch 1, tp=2, minus what the planner counts for
that model): what `cluster.reserved_gb` stands for in a plan (the comparison runs set it to 0).
"""
from __future__ import annotations

if not __package__:  # started as a file: tests.support is importable from the repository root only
    raise SystemExit("run it from the repository root as: python -m tools.peak_table")

import sys
import tempfile
from pathlib import Path


from tests.support.memory_peak import MODEL, MOE, NEAR_EMPTY, measure_peak, runtime_overhead  # noqa: E402  (tests/support/memory_peak.py)
from tests.support.ranks import run_ranks  # noqa: E402  (tests/support/ranks.py: real gloo ranks)

LAYOUTS = {  # name: (world size, overrides)
    "dp2 ZeRO-1": (2, ["zero=stage1"]),
    "dp2 ZeRO-2": (2, ["zero=stage2"]),
    "dp2 ZeRO-3": (2, ["zero=stage3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2 (ZeRO-1)": (2, ["parallel.pp=2", "zero=stage1"]),
    "tp2 x pp2 x dp2 (ZeRO-1)": (8, ["parallel.tp=2", "parallel.pp=2", "zero=stage1"]),
}
MOE_LAYOUTS = {  # tests/support/memory_peak.py: MOE (2 micro-batches per step)
    "MoE dp2 ep1 (ZeRO-1)": (2, [*MOE, "zero=stage1"]),
    "MoE dp2 ep2 (ZeRO-1)": (2, [*MOE, "zero=stage1", "parallel.ep=2"]),
}


def main(layouts: dict) -> None:
    mb = 1e6
    with tempfile.TemporaryDirectory() as tmp:
        nothing = run_ranks(measure_peak, 2, Path(tmp), overrides=[*MODEL, *NEAR_EMPTY], run_dir=f"{tmp}/run")
    overhead = runtime_overhead(nothing)
    print(f"runtime overhead per rank: {overhead / mb:.1f} MB (1-layer hidden-64 model at tp=2: measured "
          f"{max(r['measured'] for r in nothing) / mb:.1f} MB, planner {nothing[0]['planned'] / mb:.1f} MB)\n")
    print("| layout | recompute | stage | measured peak (MB, max over its ranks) | planner (MB) | planner / measured |"
          " planner: states / activations / working (MB) | planner + overhead / measured |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (world, extra) in layouts.items():
            for recompute in (False, True):
                overrides = [*MODEL, f"parallel.global_batch_size={4 * world}", *extra,
                             f"parallel.activation_checkpointing={str(recompute).lower()}"]
                results = run_ranks(measure_peak, world, Path(tmp), overrides=overrides, run_dir=f"{tmp}/run")
                for stage in sorted({r["stage"] for r in results}):
                    mine = [r for r in results if r["stage"] == stage]
                    measured = max(r["measured"] for r in mine)
                    r = mine[0]
                    print(f"| {name} | {'yes' if recompute else 'no'} | {stage} | {measured / mb:.1f} | "
                          f"{r['planned'] / mb:.1f} | {r['planned'] / measured:.3f} | {r['states'] / mb:.1f} / "
                          f"{r['activations'] / mb:.1f} / {r['working'] / mb:.1f} | {(r['planned'] + overhead) / measured:.3f} |",
                          flush=True)


if __name__ == "__main__":
    main(MOE_LAYOUTS if "--moe" in sys.argv[1:] else LAYOUTS)
