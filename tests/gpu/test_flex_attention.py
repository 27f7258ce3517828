"""One CUDA GPU: FlexCore's compiled flex_attention and create_block_mask (model/attention.py) against
SDPACore's dense mask, with gradients, and megaframe-train with data.document_mask=true on
model.attention_core=flex (opt-in; auto stays sdpa until this runs) against sdpa. The CPU suite's
tests/unit/model/test_flex_core.py checks the same through torch's eager math reference.

Written on a CPU-only machine and not yet run on a GPU: the tolerances allow for the compiled
kernels' different summation order in fp32."""
from __future__ import annotations

import pytest
import torch

from megaframe.model.attention import FlexCore, Mask, SDPACore
from megaframe.model.masking import split_documents
from tests.support.gpu_measure import gpu_env, loss_gap
from tests.support.helpers import TINY, assert_ok, read_metrics, run_cli


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize("window", [None, 50])
def test_compiled_flex_equals_sdpa_with_gradients(heads, kv_heads, window):
    torch.manual_seed(0)
    T = 300
    tokens = torch.randint(0, 40, (2, T), device="cuda")
    tokens[0, [40, 170, 171, 250]] = 99
    mask = Mask(documents=split_documents(tokens, 99).ids, window=window)
    results = []
    for core in (FlexCore(0.0), SDPACore(0.0, None, kv_heads != heads)):
        torch.manual_seed(1)
        q, k, v = (torch.randn(2, n, T, 16, device="cuda", requires_grad=True) for n in (heads, kv_heads, kv_heads))
        y = core(q, k, v, core.prepare(mask, T, q.device))
        (y * torch.linspace(-1, 1, y.numel(), device="cuda").view_as(y)).sum().backward()
        results.append([y.detach(), q.grad, k.grad, v.grad])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (name, (a - b).abs().max().item())


def test_document_masking_trains_on_flex_as_on_sdpa(tmp_path):
    runs = {}
    for core in ("flex", "sdpa"):
        result = run_cli([*TINY, "train.max_steps=10", "data.document_mask=true", f"model.attention_core={core}",
                          f"hydra.run.dir={tmp_path / core}"], env=gpu_env(), timeout=900)
        assert_ok(result)
        runs[core] = read_metrics(tmp_path / core)
    assert loss_gap(runs["flex"], runs["sdpa"]) < 1e-4
