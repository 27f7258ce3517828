"""A float64 model computes in float64 throughout: the parity tests (tests/support/parity.py) take the exact
reference of a run from megaframe's own model in float64, so no step of it may round through fp32
(the norms, RoPE, the router and the loss compute in fp32 under bf16, and stay fp64 here)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState

LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    seq_length=16, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                    tie_embeddings=False, bias=False, qk_norm=True)
FLAVOURS = {"gpt2": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16),
            "llama-qk-norm": LLAMA,
            "moe": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                               moe=MoEConfig(num_experts=4, top_k=2))}


class Downcasts(TorchDispatchMode):
    """Names every aten op that takes an fp64 tensor and returns an fp32 one: fp64 data rounded to
    fp32 (an integer count or RoPE's fp32 tables entering fp64 arithmetic round nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        takes64 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float64
                      for t in (*args, *(kwargs or {}).values()))
        gives32 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float32
                      for t in (out if isinstance(out, (tuple, list)) else (out,)))
        if takes64 and gives32:
            self.ops.add(str(func))
        return out


@pytest.mark.parametrize("name", list(FLAVOURS))
def test_no_step_of_a_float64_model_rounds_through_fp32(name):
    model = build_model(resolve_dims(FLAVOURS[name], 100), ParallelState(ParallelDims(), rank=0), seed=3).double()
    idx = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with Downcasts() as seen:
        loss = model(idx, idx)
        loss.backward()
    assert loss.dtype == torch.float64
    assert all(p.grad.dtype == torch.float64 for p in model.parameters() if p.grad is not None)
    assert not seen.ops, f"fp64 rounded to fp32 inside a float64 {name} model by {sorted(seen.ops)}"
    # the load-balancing loss's expert shares come from integer counts, which round nothing on the
    # way to fp32 but would make the shares' division fp32
    from megaframe.model.moe import MoE

    for layer in (m for m in model.modules() if isinstance(m, MoE)):
        assert layer.stats["counts"].dtype == torch.float64
