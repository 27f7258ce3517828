"""metrics.jsonl bookkeeping and the FLOPs formula."""
from __future__ import annotations

import pytest

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import resolve_dims
from megaframe.tracking.flops import matmul_parameters
from megaframe.tracking.metrics import MetricsLog, read_metrics


def test_truncate_after_drops_later_and_torn_records(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        log.append({"step": step, "loss": float(step)})
    with open(log.path, "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash mid-write
    assert log.truncate_after(3) == 3
    assert [r["step"] for r in read_metrics(log.path)] == [1, 2, 3]
    assert log.truncate_after(3) == 0


def test_matmul_parameters_of_llama2_7b():
    """N of 6N + 12·L·h·s: matmul parameters (LM head included, input embedding excluded)."""
    cfg = ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      ffn_hidden_size=11008, vocab_size=32000, seq_length=4096, norm="rmsnorm",
                      activation="swiglu", position_embedding="rope", tie_embeddings=False, bias=False)
    dims = resolve_dims(cfg, 32000)
    # Llama-2 7B: 6,738,415,616 parameters minus the 32000x4096 input embedding and the norms
    norms = 32 * 2 * 4096 + 4096
    assert matmul_parameters(dims) == 6_738_415_616 - 32000 * 4096 - norms
    # flops_per_token itself is checked against torch's FLOP counter (test_flop_counter.py)


def test_flops_formula_gives_gpt3s_published_training_compute():
    """GPT-3 175B (Brown et al. 2020, table D.1): 3.14e23 FLOPs for 300B tokens, i.e. 6·N·D."""
    from megaframe.config.schema import ModelConfig as MC

    cfg = MC(num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=49152, seq_length=2048,
             vocab_size=50257)
    n = matmul_parameters(resolve_dims(cfg, 50257))
    assert 6 * n * 300e9 == __import__("pytest").approx(3.14e23, rel=0.01)


def test_mfu_needs_a_known_peak():
    import torch

    from megaframe.tracking.flops import peak_tflops

    assert peak_tflops(123.0) == 123.0
    if not torch.cuda.is_available():
        assert peak_tflops(None) is None  # no standard CPU peak: no MFU unless configured


def test_a_profiles_gpu_gives_its_peak_in_the_runs_matmul_precision(tf32_restored):
    """cluster=h100_80g names its GPU, not one peak: an fp32 run divided by the bf16 peak (989) had
    its MFU understated 15x. The datasheet figures (tracking/flops.py) by precision, TF32 where torch
    allows it; cluster.peak_tflops, when given, in every precision."""
    import torch

    from megaframe.tracking.flops import peak_tflops

    torch.backends.cuda.matmul.allow_tf32 = False
    assert [peak_tflops(None, dtype, "H100") for dtype in ("bf16", "fp16", "fp32")] == [989.0, 989.0, 66.9]
    assert peak_tflops(None, "fp32", "H100 PCIe") == 51.2 and peak_tflops(None, "bf16", "A100") == 312.0
    torch.backends.cuda.matmul.allow_tf32 = True
    assert peak_tflops(None, "fp32", "H100") == 494.7
    assert peak_tflops(500.0, "fp32", "H100") == 500.0


def test_records_are_strict_json_with_null_for_non_finite_numbers(tmp_path):
    """train.eval_steps=0 once wrote a bare NaN: valid for Python, refused by jq and browsers."""
    import json
    import math

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 1, "loss": float("nan"), "eval_loss": float("inf"), "lr": 1e-3, "nested": [-math.inf, 2.0]})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}")) == \
        {"step": 1, "loss": None, "eval_loss": None, "lr": 1e-3, "nested": [None, 2.0]}
