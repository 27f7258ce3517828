"""fp32 tolerances taken from the arithmetic, not from one machine.

Two fp32 computations of the same quantity that sum in different orders (a ring of blocks against
one SDPA call, per-rank partial sums against one matmul) differ by a few ulps of the accumulated
magnitudes, and how many depends on the host: its SIMD width (AVX2, AVX-512) and thread count
change the order inside every kernel. A fixed bound such as 1e-6 is fitted to one host and fails on
another (issue: the suite fails on an AVX-512 host).

So each comparison measures the fp32 rounding of the case at hand: the reference is computed in
float64 and in float32 by the same independent implementation, and the tested fp32 value must lie
within FACTOR times the fp32 reference's own worst distance from float64. That allowance scales
with the magnitudes and the number of accumulated terms of that very tensor on that very host. A bug
(a skipped block, a tile at the wrong offset, a missing GQA head) moves values by O(magnitude),
orders of magnitude above it, so the tests keep their power (the seeded ring bugs of
tests/dist/test_context_parallel.py prove it).

MEGAFRAME_NUMERICS_REPORT=FILE appends each comparison's ratio (tested error / fp32 reference's
error) to FILE, to re-derive FACTOR on a new host (tools/numerics_hosts.sh).
"""
from __future__ import annotations

import json
import os

import torch

FP32_EPS = torch.finfo(torch.float32).eps
# The worst ratio measured over the suite's uses (python tools/numerics_hosts.py on a 2-core AMD EPYC
# with AVX2: ATEN_CPU_CAPABILITY default and avx2, 1 and 2 threads) was 2.68, the ring with dropout
# under `default`; the seeded mutants in tests/dist/test_context_parallel.py stay at 2e6 or more.
# 8 leaves room for a host that orders its sums worse, five orders of magnitude below a bug.
FACTOR = 8.0


def fp32_allowance(ref32: torch.Tensor, ref64: torch.Tensor, factor: float = FACTOR) -> float:
    """FACTOR x the fp32 reference's worst distance from fp64 over the tensor; at least one fp32 ulp
    of the tensor's largest magnitude (a reference that happens to round exactly gives no scale)."""
    own = (ref32.double() - ref64).abs().max().item()
    floor = FP32_EPS * ref64.abs().max().item()
    return factor * max(own, floor)


def assert_fp32_close(got: torch.Tensor, ref64: torch.Tensor, ref32: torch.Tensor, what: str = "",
                      factor: float = FACTOR) -> None:
    """`got` (fp32, computed another way) is within factor x the fp32 reference's own rounding error
    of the fp64 reference, element by element."""
    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} vs reference {tuple(ref64.shape)}"
    allowance = fp32_allowance(ref32, ref64, factor)
    worst = (got.double() - ref64).abs().max().item()
    _report(what, worst, allowance / factor)
    assert worst <= allowance, (f"{what}: {worst:.3g} from the fp64 reference, over {factor:g}x the fp32 "
                                f"reference's own rounding ({allowance / factor:.3g})")


def _report(what: str, worst: float, own: float) -> None:
    path = os.environ.get("MEGAFRAME_NUMERICS_REPORT")
    if path:
        with open(path, "a") as f:  # one short line per write: safe from concurrent test processes
            f.write(json.dumps({"what": what, "ratio": worst / own if own else (0.0 if worst == 0 else float("inf")),
                                "worst": worst, "own": own,
                                "capability": os.environ.get("ATEN_CPU_CAPABILITY", "host"),
                                "threads": torch.get_num_threads()}) + "\n")
