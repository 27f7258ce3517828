"""tools/bench.py --device cuda on the CUDA-shaped device (tests/support/fakecuda): the GPU benchmark's own code
path (megaframe, the plain PyTorch loop and transformers one after the other on the device, CUDA's
synchronize and memory counters, the MFU table) at a tiny shape, with no device violation. The
figures it prints here mean nothing; that it runs is what a lent GPU's short time must not be spent on."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.fakecuda.env import fake_cuda_env
from tests.support.fakecuda.ledger import read_reports
from tests.support.helpers import REPO, assert_ok

pytestmark = pytest.mark.slow
SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=256", "model.seq_length=32",
         "parallel.micro_batch_size=2", "parallel.global_batch_size=4"]


def test_the_benchmarks_cuda_mode_runs_on_the_device(tmp_path):
    reports = tmp_path / "reports"
    result = subprocess.run([sys.executable, "tools/bench.py", "--device", "cuda", "--steps", "1", "--repeats", "1",
                             "--warmup", "1", "--no-compile", *SHAPE], cwd=REPO, env=fake_cuda_env(reports),
                            capture_output=True, text=True, timeout=600)
    assert_ok(result)
    assert "gpt2 on NVIDIA H100" in result.stdout, result.stdout[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["megaframe", "pytorch", "transformers", "nanogpt loop",
                                                          "nanogpt model"], rows
    assert all(float(row.split("|")[2].replace(",", "")) > 0 for row in rows), rows
    (report,) = [r for r in read_reports(reports) if "tools/bench.py" in r["argv"]]
    assert report["violations"] == [], report["violations"]
    # attention ran through the device's (emulated) CUDA kernel, so the paths trained on the device
    assert report["kernels"].get("aten._scaled_dot_product_efficient_attention.default"), report["kernels"]
