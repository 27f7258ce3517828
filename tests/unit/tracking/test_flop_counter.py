"""The FLOPs formula behind TFLOP/s and MFU (PaLM: 6·N + 12·L·h·s per token) against an
independent count: torch's FlopCounterMode over one forward and backward pass of a small GPT-2 and
a small Llama with grouped-query attention. SDPA runs its math kernel here so the counter sees the
attention matmuls (its fused CPU kernel is not in the counter's table); the formula counts them as
the math kernel does, without halving for the causal mask."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from megaframe.tracking.flops import device_peak_tflops, flops_per_token, matmul_precision

B, T = 2, 256


def _config(arch: str) -> ModelConfig:
    llama = arch == "llama"
    return ModelConfig(arch=arch, num_layers=2, hidden_size=128, num_attention_heads=8, seq_length=T,
                       num_kv_heads=2 if llama else None, norm="rmsnorm" if llama else "layernorm",
                       activation="swiglu" if llama else "gelu", position_embedding="rope" if llama else "learned",
                       tie_embeddings=not llama, bias=not llama)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_formula_matches_torchs_flop_counter(arch):
    dims = resolve_dims(_config(arch), 1000)
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=0)
    idx = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    counted = counter.get_total_flops()
    by_op = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    # measured: equal to the last FLOP for both (GPT-2 2,013,265,920; Llama with GQA 1,962,934,272)
    assert counted == pytest.approx(flops_per_token(dims) * B * T, rel=0.05), by_op
    # the attention term alone: the score and value matmuls (batched) are 12·L·h·s per token
    assert by_op["aten.bmm"] == pytest.approx(12 * dims.num_layers * dims.hidden_size * T * B * T, rel=0.05)


def test_mfu_peak_follows_the_runs_matmul_precision():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", matmul_precision("bf16", tf32=True)) == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    # an fp32 run is not divided by the bf16 peak: TF32 where torch allows it, else true fp32
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", matmul_precision("fp32", tf32=True)) == 156.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", matmul_precision("fp32", tf32=False)) == 19.5
    assert device_peak_tflops("Tesla T4", "bf16") is None


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's counter (2.13) has no entry for the grouped GEMM: 2 x rows x in x out, whatever the groups."""
    return 2 * a_shape[0] * a_shape[-1] * b_shape[-1]


def _moe_config(**moe) -> ModelConfig:
    from megaframe.config.schema import MoEConfig

    cfg = _config("llama")
    cfg.moe = MoEConfig(**{"num_experts": 8, "top_k": 2, "ffn_hidden_size": 96, **moe})
    return cfg


def _counted(dims, grouped: bool, monkeypatch) -> tuple[int, dict]:
    """FLOPs torch counts in one forward and backward. grouped=False runs the experts as the loop
    reference (grouped_linear's fallback: one plain matmul per expert on the rows it was sent),
    which torch's counter knows without help."""
    import megaframe.model.moe as moe

    if not grouped:
        monkeypatch.setattr(moe, "_grouped_mm_works", lambda *args: False)
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=0)
    idx = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(0))
    mapping = {torch.ops.aten._grouped_mm: _grouped_mm_flops} if grouped else {}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(idx, idx).backward()
    return counter.get_total_flops(), {str(op): f for op, f in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("moe", [{"shared_experts": 1}, {"first_dense_layers": 1}, {"top_k": 1, "num_experts": 4}])
def test_moe_formula_counts_the_active_parameters_torch_executes(moe, monkeypatch):
    """Mixture-of-Experts: the formula's N is the active parameters (router, top_k experts, shared
    experts). Independent of it: the loop reference's per-expert matmuls, counted by torch itself
    on the rows each expert was sent (counting all E experts would be 4x the expert FLOPs here).
    With a dense first block, both kinds of MLP are in the count."""
    dims = resolve_dims(_moe_config(**moe), 1000)
    counted, by_op = _counted(dims, grouped=False, monkeypatch=monkeypatch)
    assert "aten._grouped_mm" not in by_op
    assert counted == pytest.approx(flops_per_token(dims) * B * T, rel=0.05), by_op


def test_grouped_gemm_counts_what_the_loop_reference_does(monkeypatch):
    """The grouped GEMM (torch's counter taught its shape rule) runs exactly the loop's FLOPs."""
    dims = resolve_dims(_moe_config(shared_experts=1), 1000)
    grouped, by_op = _counted(dims, grouped=True, monkeypatch=monkeypatch)
    assert by_op["aten._grouped_mm"] > 0, by_op
    loop, _ = _counted(dims, grouped=False, monkeypatch=monkeypatch)
    assert grouped == loop


def test_attention_flops_follow_head_dim_not_hidden():
    """Qwen3's shape: heads x head_dim (8 x 32 = 256) twice the hidden size, with QK-norm. The
    score and value matmuls are 12·L·(heads·head_dim)·s per token; 12·L·h·s would count half."""
    cfg = _config("llama")
    cfg.head_dim, cfg.qk_norm = 32, True
    dims = resolve_dims(cfg, 1000)
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=0)
    idx = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    by_op = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert by_op["aten.bmm"] == pytest.approx(12 * dims.num_layers * 8 * 32 * T * B * T, rel=0.05), by_op
    assert counter.get_total_flops() == pytest.approx(flops_per_token(dims) * B * T, rel=0.05), by_op
