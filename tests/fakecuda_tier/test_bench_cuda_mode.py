"""tools/bench.py --device cuda on the CUDA-shaped device (tests/support/fakecuda): the GPU benchmark's own code
path (megaframe, the plain PyTorch loop and transformers one after the other on the device, CUDA's
synchronize and memory counters, the MFU table) at a tiny shape, with no device violation. The
figures it prints here mean nothing; that it runs is what a lent GPU's short time must not be spent on.
Its variant options (--precision fp8, --optim muon, --document-mask: megaframe against its own
baseline, tools/gpu_tier.sh's fp8 rows) on the device, and their mistakes refused before any timing."""
from __future__ import annotations

import re
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


def bench_rows(stdout: str) -> list[str]:
    """The first cell of each table row the benchmark printed."""
    return [line.split("|")[1].strip() for line in stdout.splitlines()
            if line.startswith("| ") and "tokens/s" not in line]


def test_fp8_against_bf16_on_the_device(tmp_path):
    """gpu_tier.sh's first part at a tiny shape: megaframe in fp8 (the device's fp8 path, not the
    CPU's emulation) and its bf16 run on the device, their step-time ratio, no device violation."""
    reports = tmp_path / "reports"
    result = subprocess.run([sys.executable, "tools/bench.py", "--device", "cuda", "--steps", "1", "--repeats", "1",
                             "--warmup", "1", "--no-compile", "--precision", "fp8", "--fp8-recipe", "rowwise", *SHAPE],
                            cwd=REPO, env=fake_cuda_env(reports), capture_output=True, text=True, timeout=600)
    assert_ok(result)
    assert bench_rows(result.stdout) == ["megaframe", "megaframe (bf16)"], result.stdout[-2000:]
    ratio = re.search(r"^step time megaframe / megaframe \(bf16\): ([\d.]+)", result.stdout, re.M)
    assert ratio and float(ratio.group(1)) > 0, result.stdout[-2000:]
    (report,) = [r for r in read_reports(reports) if "tools/bench.py" in r["argv"]]
    assert report["violations"] == [], report["violations"]


@pytest.mark.parametrize("argv, said", [  # config overrides after "--", the tiny shape's before them
    (["--fp8-recipe", "rowwise"], "--fp8-recipe rowwise is read only with --precision fp8"),
    (["--shape", "llama8b"], "--shape llama8b is a Llama shape (grouped-query attention); use --arch llama"),
    (["--compile-only"], "--no-compile and --compile-only leave no megaframe path"),
    (["--cpu-time", "--device", "cuda"], "--cpu-time times the host's work in this process; --device cuda"),
    # the options reach megaframe's own rules: Muon with an offloaded optimizer, MXFP8 on widths not of 32
    (["--optim", "muon", "zero=stage2", "offload=cpu"], "optim=muon with offload.optimizer=cpu"),
    (["--precision", "fp8", "--fp8-recipe", "mxfp8", "--", "model.ffn_hidden_size=1000"], "precision.fp8.recipe=mxfp8"),
])
def test_the_benchmarks_variant_mistakes_are_one_line_before_any_timing(argv, said, capsys, monkeypatch):
    """In process (bench.main): exit 2 and one line naming the option or key, before a model is built."""
    from tools import bench

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # main sets it for the device it benchmarks
    with pytest.raises(SystemExit) as exit_:  # a missed refusal times one tiny step instead, and fails here
        cut = argv.index("--") if "--" in argv else len(argv)
        bench.main(["--steps", "1", "--repeats", "1", "--warmup", "1", "--no-compile", *argv[:cut], *SHAPE,
                    *argv[cut + 1:]])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("bench: error: ") and said in err, err
    assert len(err.strip().splitlines()) == 1, err
