"""ZeRO-3 builds the model partitioned: no rank holds the whole model while constructing it.

A 57M-parameter model (8 layers, hidden 768) is built at dp=4 with ZeRO-3 on real gloo ranks; the
resident memory the build adds on each rank at its peak (the kernel's high-water mark) must stay
below 40% of the full fp32 model: its own partition is 25%, the rest is one module's or one
parameter's full value at a time (measured: the whole-model build it replaces adds 109%). That the
partitioned build starts from the same weights as every other layout is checked by the ZeRO
parity tests (test_zero.py: step 1's loss equals the single-rank run's)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow

MODEL = ["model.num_layers=8", "model.hidden_size=768", "model.num_attention_heads=12", "model.ffn_hidden_size=3072",
         "model.seq_length=32", "parallel.micro_batch_size=1", "parallel.global_batch_size=4", "train.max_steps=1",
         "logging.wandb.mode=disabled", "logging.progress_bar=false", "zero=stage3"]


def _measure_build(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    from tests.support.memory_probe import fixed_mmap_threshold, peak_rss

    import megaframe.backends.deepspeed.engine as engine
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    fixed_mmap_threshold()
    build = engine.build_model
    measured = {}

    def measured_build(*args, **kwargs):
        with peak_rss() as peak:
            model = build(*args, **kwargs)
        measured["extra"] = peak["extra"]
        return model
    engine.build_model = measured_build
    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    return {**measured, "params": trainer.backend.num_parameters, "partitioned": trainer.backend.built_partitioned}


def test_zero3_dp4_builds_a_57m_model_without_holding_it(tmp_path):
    results = run_ranks(_measure_build, 4, tmp_path, overrides=MODEL, run_dir=str(tmp_path / "run"))
    # the same probe on the whole-model build (ZeRO-1 partitions only the optimizer): it sees it all
    whole = run_ranks(_measure_build, 4, tmp_path, overrides=[*MODEL, "zero=stage1"], run_dir=str(tmp_path / "run1"))
    full_fp32 = 4 * results[0]["params"]
    assert results[0]["params"] >= 50e6
    for rank, (r, w) in enumerate(zip(results, whole)):
        assert r["partitioned"] and not w["partitioned"]
        assert r["extra"] < 0.4 * full_fp32, (rank, r["extra"], full_fp32)
        assert w["extra"] > 0.9 * full_fp32, (rank, w["extra"], full_fp32)
    print(f"build peak extra per rank: ZeRO-3 {[round(r['extra'] / 1e6, 1) for r in results]} MB, whole model "
          f"{[round(w['extra'] / 1e6, 1) for w in whole]} MB, fp32 model {full_fp32 / 1e6:.1f} MB")
