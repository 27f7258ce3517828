"""The planner under context parallelism: the bytes one block saves for backward on a cp rank,
predicted exactly (ring and Ulysses, fp32 and bf16), against saved-tensor hooks on real gloo ranks,
and the whole model within the planner's 15%."""
from __future__ import annotations

import pytest
import torch

from megaframe.config.schema import ModelConfig
from megaframe.model.factory import resolve_dims
from megaframe.model.gpt import GPT
from megaframe.parallel.context import ContextGroup, zigzag_shard
from megaframe.plan.activations import ActivationShape, block_activation_bytes, stage_activation_bytes
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
LLAMA = dict(arch="llama", num_kv_heads=2, norm="rmsnorm", activation="swiglu", position_embedding="rope",
             tie_embeddings=False, bias=False)


def _saved(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def _measure(rank: int, world: int, impl: str, dtype: str, dropout: float = 0.0) -> tuple[int, int]:
    cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=256,
                      dropout=dropout, **LLAMA)
    dims = resolve_dims(cfg, 256)
    torch.manual_seed(0)
    model = GPT(dims, context=ContextGroup(None, tuple(range(world)), rank), cp_impl=impl).train()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(4, 128 // world, 256, dtype=next(model.parameters()).dtype, requires_grad=True)
    block = _saved(lambda: model.blocks[0](x))
    inputs, targets = (zigzag_shard(torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(seed)),
                                    world, rank) for seed in (1, 2))
    whole = _saved(lambda: model(inputs, targets))
    return (sum(n for p, n in block.items() if p not in params), sum(n for p, n in whole.items() if p not in params))


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
@pytest.mark.parametrize("dtype, dropout", [("fp32", 0.0), ("bf16", 0.0), ("fp32", 0.1), ("bf16", 0.1)])
def test_block_and_model_activations_under_cp(tmp_path, impl, dtype, dropout):
    """With dropout: ring attention keeps no masks (it redraws them), Ulysses' SDPA on CPU takes
    the math path over the whole sequence on its heads/cp heads."""
    cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=256,
                      dropout=dropout, **LLAMA)
    dims = resolve_dims(cfg, 256)
    shape = ActivationShape(4, dtype=dtype, device="cpu", cp=2, cp_impl=impl)
    for block, whole in run_ranks(_measure, 2, tmp_path, timeout=300, impl=impl, dtype=dtype, dropout=dropout):
        assert block_activation_bytes(dims, shape) == block
        assert stage_activation_bytes(dims, shape, 2, True, True, False) == pytest.approx(whole, rel=0.15)
