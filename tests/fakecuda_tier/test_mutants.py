"""The tier catches megaframe bugs that pass on the CPU: each seeded bug (tests/support/fakecuda/mutants.py) runs
through megaframe-train twice, on plain CPU ranks (where it passes unnoticed) and on the CUDA-shaped
device (where it must fail as CUDA or NCCL would, or break the host-sync budget)."""
from __future__ import annotations

import pytest

from tests.support.fakecuda.env import fake_cuda_env
from tests.support.helpers import TINY, assert_ok, run_cli

pytestmark = pytest.mark.slow
SHORT = ["train.max_steps=2", "train.eval_interval=0"]


def _mutated(tmp_path, mutant: str, extra: list[str], device: bool):
    env = fake_cuda_env(tmp_path / "reports", MEGAFRAME_FAKE_CUDA_MUTANT=mutant)
    if not device:
        env["MEGAFRAME_FAKE_CUDA"] = "0"
    name = "device" if device else "cpu"
    return run_cli([*TINY, *SHORT, *extra, f"hydra.run.dir={tmp_path / name}"], env=env)


@pytest.mark.parametrize("mutant, extra, refusal, cpu_control", [
    ("init_on_default_device", ["zero=stage3"], "Expected a 'cuda' device type for generator", True),
    # (its CPU control, two gloo ranks, would cost CI 15 s: gloo all-reduces host tensors, as tests/dist shows)
    ("host_dp_mean", ["parallel.dp=2", "zero=stage1"], "Tensors must be CUDA and dense", False),
])
def test_a_seeded_bug_passes_on_the_cpu_and_fails_on_the_device(mutant, extra, refusal, cpu_control, tmp_path):
    if cpu_control:
        assert_ok(_mutated(tmp_path, mutant, extra, device=False))
    result = _mutated(tmp_path, mutant, extra, device=True)
    assert result.returncode != 0, result.stdout[-2000:]
    assert refusal in result.stderr, result.stderr[-3000:]
