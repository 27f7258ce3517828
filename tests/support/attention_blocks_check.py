"""The check behind tests/unit/parallel/test_attention_blocks.py and its CUDA twin in tests/gpu: a
ring attention block kernel (parallel/attention_blocks.py) against full causal SDPA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megaframe.parallel.attention_blocks import block_kernel


def blocks_against_full_attention(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Worst absolute deviation of output and q/k/v gradients from full causal SDPA (computed in fp64)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D, split = 2, 4, 24, 16, 8  # keys [0, 8) an earlier block; queries [8, 24) with keys [8, 24) causal
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(4))
    scale = D ** -0.5
    kernel = block_kernel(q)
    assert kernel is not None, f"no fused block kernel for {device} {dtype}"
    rows = slice(split, T)
    qr = q[:, :, rows].contiguous()
    blocks = [(k[:, :, :split].contiguous(), v[:, :, :split].contiguous(), False),
              (k[:, :, rows].contiguous(), v[:, :, rows].contiguous(), True)]
    results = [kernel.forward(qr, kb, vb, causal, scale) for kb, vb, causal in blocks]
    math = torch.promote_types(dtype, torch.float32)  # the merge's precision, as the ring's
    lse = torch.logsumexp(torch.stack([r[1].to(math) for r in results]), dim=0)
    out = sum(r[0].to(math) * torch.exp(r[1].to(math) - lse)[..., None] for r in results)
    grads = [kernel.backward(dout[:, :, rows].contiguous(), qr, kb, vb, out.to(dtype).contiguous(), lse, r[2],
                             causal, scale) for (kb, vb, causal), r in zip(blocks, results)]
    dq = sum(gr[0].to(math) for gr in grads)
    dk = torch.cat([grads[0][1].to(math), grads[1][1].to(math)], dim=2)
    dv = torch.cat([grads[0][2].to(math), grads[1][2].to(math)], dim=2)

    # the reference: queries [8, 24) of a causal attention over all 24 positions
    q64, k64, v64 = (t.double().cpu().requires_grad_() for t in (q, k, v))
    full = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=scale)
    full[:, :, rows].backward(dout[:, :, rows].double().cpu())
    want = {"output": full[:, :, rows].detach(), "grad q": q64.grad[:, :, rows], "grad k": k64.grad[:, :, :T],
            "grad v": v64.grad[:, :, :T]}
    got = {"output": out, "grad q": dq, "grad k": dk, "grad v": dv}
    return {name: (got[name].double().cpu() - want[name]).abs().max().item() for name in want}


def full_attention_rounding(dtype: torch.dtype) -> dict[str, float]:
    """The same deviations for one full causal SDPA call on the host in `dtype`: the rounding of
    that precision on this host, which bounds what the blocks may add (tests/support/numerics.py)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D, split = 2, 4, 24, 16, 8
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    results = {}
    for precision in (dtype, torch.float64):
        leaves = [t.to(precision).clone().requires_grad_() for t in (q, k, v)]
        full = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=D ** -0.5)
        full[:, :, split:].backward(dout[:, :, split:].to(precision))
        results[precision] = {"output": full[:, :, split:].detach(), "grad q": leaves[0].grad[:, :, split:],
                              "grad k": leaves[1].grad, "grad v": leaves[2].grad}
    return {name: (results[dtype][name].double() - results[torch.float64][name]).abs().max().item()
            for name in results[dtype]}
