"""ZeRO stages and offload with real gloo ranks reproduce the single-rank run: fp32, 12 steps, every
logged loss, gradient norm and eval loss within rtol 1e-5 (tests/support/parity.py).

The reference is one rank with torch's AdamW and no ZeRO. Offloaded runs use DeepSpeed's CPU Adam
(a fused C++ kernel) against that same reference: in fp32 it matches torch's AdamW to 1e-5 over
these 12 steps, so the offload cases need no reference of their own.
tp=2 x dp=2 with ZeRO 0-3 is in test_tensor_parallel.py; tp=2 x dp=2 with offload is here.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.support.parity import assert_parity, train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=12", "train.eval_interval=6"]
CPU_OFFLOAD = {"zero2-cpu-optimizer": ["zero=stage2", "offload=cpu"],
               "zero3-cpu-optimizer": ["zero=stage3", "offload=cpu"],
               "zero3-cpu-param": ["zero=stage3", "offload.param=cpu"]}
# NVMe swapping moves only tensors of >= 1 MiB: hidden 512 gives 4 MiB MLP matrices and 3 MiB QKV.
NVME_MODEL = ["model.num_layers=1", "model.hidden_size=512", "model.num_attention_heads=4",
              "model.ffn_hidden_size=2048", "model.seq_length=16", "train.max_steps=12", "train.eval_interval=6"]
# max_in_cpu=0: no parameter stays in CPU memory, so every swappable one goes through the disk
NVME = ["zero=stage3", "offload=nvme", "offload.param_buffer_size=2000000", "offload.param_max_in_cpu=0"]


def _runs(root: Path, cases: dict[str, list[str]], base: list[str]) -> list[tuple[list[str], str]]:
    return [([*base, *extra], str(root / name)) for name, extra in cases.items()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The single-rank run (trained once per session: the same run as other files' gpt2 reference)."""
    return read_metrics(reference_runs({"ref": [*TINY, *STEPS]}, tmp_path_factory.mktemp("single"))["ref"])


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_stages_match_single_rank(dp, reference, tmp_path, deepspeed_ops):
    cases = {f"zero{stage}": [f"zero=stage{stage}"] for stage in range(4)}
    if dp == 2:
        cases.update(CPU_OFFLOAD)
    runs = _runs(tmp_path, cases, [*TINY, *STEPS, f"parallel.dp={dp}"])
    deepspeed_ops(*(overrides for overrides, _ in runs))
    run_ranks(train_runs, dp, tmp_path, runs=runs)
    for name, (_, run_dir) in zip(cases, runs):
        assert_parity(read_metrics(run_dir), reference, f"dp={dp} {name}")


def test_offload_under_tensor_parallelism_matches_single_rank(reference, tmp_path, deepspeed_ops):
    cases = {"zero2-cpu-optimizer": CPU_OFFLOAD["zero2-cpu-optimizer"],
             "zero3-cpu-optimizer-and-param": ["zero=stage3", "offload=cpu", "offload.param=cpu"]}
    runs = _runs(tmp_path, cases, [*TINY, *STEPS, "parallel.tp=2", "parallel.dp=2"])
    deepspeed_ops(*(overrides for overrides, _ in runs))
    run_ranks(train_runs, 4, tmp_path, runs=runs)
    for name, (_, run_dir) in zip(cases, runs):
        assert_parity(read_metrics(run_dir), reference, f"tp=2 dp=2 {name}")


def _train_recording_swap(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    """Train; report the swap files this rank wrote (read before shutdown) and whether they were removed."""
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    cfg, _ = compose(overrides)
    with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
        trainer.fit()
        files = trainer.backend.nvme_swap.files()
    return {"folder": str(trainer.backend.nvme_swap.path), "files": files, "left": trainer.backend.nvme_swap.path.exists()}


def test_zero3_nvme_offload_swaps_to_disk_and_matches_single_rank(tmp_path, deepspeed_ops):
    base = [*TINY, *NVME_MODEL]
    deepspeed_ops([*base, *NVME])
    run_ranks(train_runs, 1, tmp_path, runs=[(base, str(tmp_path / "ref"))])
    nvme_path = tmp_path / "nvme"
    results = run_ranks(_train_recording_swap, 2, tmp_path, run_dir=str(tmp_path / "nvme-run"),
                        overrides=[*base, *NVME, "parallel.dp=2", f"offload.nvme_path={nvme_path}"])
    assert_parity(read_metrics(tmp_path / "nvme-run"), read_metrics(tmp_path / "ref"), "dp=2 zero3 nvme")
    for rank, result in enumerate(results):
        big = {name: size for name, size in result["files"].items() if size >= 2**20}
        assert any("/optimizer/" in name for name in big), f"rank {rank}: no optimizer swap file: {result['files']}"
        assert any("params/" in name for name in big), f"rank {rank}: no parameter swap file: {result['files']}"
        assert not result["left"], f"rank {rank} left its swap folder {result['folder']}"
    assert not (nvme_path / "megaframe-swap").exists(), "the last process out removes the shared folder"
