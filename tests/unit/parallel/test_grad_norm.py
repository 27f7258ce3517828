"""The ZeRO-0 fp32 gradient norm we measure ourselves must agree with DeepSpeed's fp64 norm (the
other stages report that one), so curves stay comparable across ZeRO stages, and it must be the
same number on every x86-64 host, whatever its vector width (ATEN_CPU_CAPABILITY) and threads."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from megaframe.parallel import grad_norm as grad_norm_module
from megaframe.parallel.grad_norm import grad_norm
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

# Squares of fp32 values are exact in fp64 and ~200k of them sum with a relative error below
# 200k * 1.1e-16 = 2.2e-11; an fp32 accumulation misses this bound by five orders of magnitude
# (2.9e-6 at one thread, 1.3e-6 at two on this data).
BOUND = 1e-10


def _wide_range_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 384, bias=True), torch.nn.Linear(384, 16, bias=False))
    for p in model.parameters():
        # rows spanning many orders of magnitude, like an embedding gradient: fp32 lane-wise
        # accumulation (torch's CPU norm, an fp32 dot) is 1e-6 to 1e-5 off here
        p.grad = torch.randn_like(p) * torch.rand(p.shape[0], *[1] * (p.dim() - 1)) ** 8
    return model


def _exact(model: torch.nn.Module) -> float:
    return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]).norm().item()


@pytest.mark.numerics
@pytest.mark.parametrize("threads", [1, 2])
def test_grad_norm_matches_the_fp64_norm_on_a_wide_dynamic_range(threads):
    model, before = _wide_range_model(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = grad_norm(model, ParallelState(ParallelDims(), rank=0))
    finally:
        torch.set_num_threads(before)
    exact = _exact(model)
    assert abs(got - exact) <= BOUND * exact, f"{threads} threads: {got} vs {exact}"


def test_grad_norm_spans_chunks(monkeypatch):
    """Tensors longer than one fp64 chunk are summed chunk by chunk, none dropped or counted twice."""
    monkeypatch.setattr(grad_norm_module, "_SQUARES_CHUNK", 1000)  # the 512x384 weight is 197 chunks, the last short
    model = _wide_range_model()
    exact = _exact(model)
    assert abs(grad_norm(model, ParallelState(ParallelDims(), rank=0)) - exact) <= BOUND * exact


def test_small_tensors_are_packed_into_chunks_none_dropped_or_counted_twice(monkeypatch):
    """Tensors smaller than a chunk share one: 200 of 7..13 elements, packed into chunks of at most 50,
    with a tensor as long as a chunk among them, sum to the exact fp64 squares."""
    from megaframe.parallel.grad_norm import _sum_of_squares

    monkeypatch.setattr(grad_norm_module, "_SQUARES_CHUNK", 50)
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(7 + i % 7, generator=generator) * 10.0 ** (i % 3 - 1) for i in range(200)]
    grads.insert(57, torch.randn(50, generator=generator))
    exact = math.fsum(float(x) ** 2 for g in grads for x in g.double())
    assert abs(_sum_of_squares(grads).item() - exact) <= 1e-13 * exact
    # a dropped tensor or one counted twice moves the sum by at least the smallest tensor's squares
    smallest = min(math.fsum(float(x) ** 2 for x in g.double()) for g in grads)
    assert smallest > 1e-13 * exact


_NORM_IN_CHILD = """
import sys, torch
from megaframe.parallel.grad_norm import _sum_of_squares
print(repr(_sum_of_squares(torch.load(sys.argv[1])).item()), torch.backends.cpu.get_cpu_capability())
"""


def test_grad_norm_is_the_same_under_every_cpu_capability(tmp_path):
    """What broke the NVMe parity test on an AVX2 host: the same gradients, summed by processes that
    take torch's default, AVX2 and host code paths, give sums within 1e-12 of each other."""
    grads = [p.grad for p in _wide_range_model().parameters()]
    torch.save(grads, tmp_path / "grads.pt")
    sums, seen = [], set()
    for capability in ("default", "avx2", None):
        env = {"OMP_NUM_THREADS": "1", **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
        out = subprocess.run([sys.executable, "-c", _NORM_IN_CHILD, str(tmp_path / "grads.pt")], check=True,
                             capture_output=True, text=True, env={**_base_env(), **env}).stdout.split()
        sums.append(float(out[0]))
        seen.add(out[1])
    assert {"DEFAULT", "AVX2"} <= seen, f"the capabilities were not applied: {seen}"
    assert max(sums) - min(sums) <= 1e-12 * max(sums), sums


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}


def test_grad_norm_skips_parameters_without_gradients():
    model = torch.nn.Linear(4, 3)
    model.weight.grad = torch.full((3, 4), 2.0)
    assert grad_norm(model, ParallelState(ParallelDims(), rank=0)) == pytest.approx(48 ** 0.5, rel=1e-12)


def test_the_accelerator_path_is_as_exact_and_launches_per_tensor_not_per_chunk():
    """On an accelerator the squares come from one fp64-accumulating norm per tensor (launched
    together): as exact as the CPU's fp64 chunks, and its kernel count does not grow with the
    tensors' size, where the CPU path's grows by three per 2^18 elements."""
    from tests.support.kernel_syncs import OpCounter
    from megaframe.parallel.grad_norm import _chunked_squares, _fused_squares

    grads = [p.grad for p in _wide_range_model().parameters()]
    exact = _exact(_wide_range_model()) ** 2
    assert abs(_fused_squares(grads, "cpu").item() - exact) <= BOUND * exact
    counts = []
    for elements in (1 << 18, 1 << 22):
        big = [torch.randn(elements), *grads]
        with OpCounter() as fused:
            _fused_squares(big, "cpu")
        with OpCounter() as chunked:
            _chunked_squares(big)
        counts.append((fused.total, chunked.total))
    assert counts[0][0] == counts[1][0], counts  # per tensor: the same kernels for 16x the elements
    assert counts[1][1] > counts[0][1] + 40, counts  # the chunks: the CPU path's count grows
