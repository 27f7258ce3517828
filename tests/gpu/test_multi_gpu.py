"""Two or more CUDA GPUs: dp=2, tp=2 and pp=2 on NCCL reproduce the one-GPU run (fp32); so do
context parallelism (ring and Ulysses: point-to-point and all-to-all on NCCL) and expert
parallelism (MoE all-to-all, under ZeRO-1 and ZeRO-3). Skipped below two GPUs. Written on a
CPU-only machine and not yet run on GPUs."""
from __future__ import annotations

import pytest
import torch

from tests.support.helpers import TINY, assert_ok, cli_env, curve, read_metrics, run_cli

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
STEPS = ["train.max_steps=20", "train.eval_interval=10"]


@pytest.mark.parametrize("layout", [["parallel.dp=2", "zero=stage1"], ["parallel.tp=2"],
                                    ["parallel.pp=2", "model.num_layers=4", "zero=stage1"],
                                    ["model=llama_tiny", "model.num_kv_heads=2", "parallel.cp=2"],
                                    ["model=llama_tiny", "model.num_kv_heads=2", "parallel.cp=2",
                                     "parallel.cp_impl=ulysses"],
                                    ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "zero=stage1"],
                                    ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "zero=stage3"]])
def test_two_gpus_match_one(layout, tmp_path):
    env = cli_env(DS_ACCELERATOR="cuda")
    model = [a for a in layout if a.startswith("model")]
    assert_ok(run_cli([*TINY, *STEPS, *model, f"hydra.run.dir={tmp_path / 'one'}"], env=env, timeout=900))
    result = run_cli([*TINY, *STEPS, *layout, f"hydra.run.dir={tmp_path / 'two'}"], env=env, timeout=900)
    assert_ok(result)
    for key in ("loss", "grad_norm", "eval_loss"):
        for (s, a), (_, b) in zip(curve(read_metrics(tmp_path / "two"), key), curve(read_metrics(tmp_path / "one"), key)):
            assert a == pytest.approx(b, rel=1e-4), (layout, key, s, a, b)
