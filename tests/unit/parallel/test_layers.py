"""fused_column_linear: one GEMM over several column-parallel layers, identical to running them apart."""
from __future__ import annotations

import torch

from megaframe.parallel.layers import ColumnParallelLinear, TPGroup, fused_column_linear


def _layers(bias: bool) -> list[ColumnParallelLinear]:
    torch.manual_seed(0)
    layers = [ColumnParallelLinear(16, n, TPGroup(), bias=bias, enter=False) for n in (16, 8, 8)]
    for layer in layers:
        torch.nn.init.normal_(layer.weight)
        if bias:
            torch.nn.init.normal_(layer.bias)
    return layers


def _outputs_and_grads(layers, run):
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    outs = run(x, layers)
    sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()  # different weights per output
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()] + [x.grad.clone()]
    for layer in layers:
        layer.zero_grad()
    return outs, grads


def test_fused_matches_separate_layers_in_values_and_gradients():
    for bias in (True, False):
        layers = _layers(bias)
        fused, fused_grads = _outputs_and_grads(layers, fused_column_linear)
        apart, apart_grads = _outputs_and_grads(layers, lambda x, ls: [layer(x) for layer in ls])
        assert [o.shape for o in fused] == [(3, 5, 16), (3, 5, 8), (3, 5, 8)]
        for a, b in zip(fused + fused_grads, apart + apart_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_zero3_partitioned_layers_run_one_by_one():
    """ZeRO-3 gathers a weight in its own module's forward hook: fusing would read empty partitions."""
    layers = _layers(bias=False)
    calls = []
    for layer in layers:
        layer.weight.ds_id = 0  # what deepspeed.zero marks partitioned parameters with
        layer.register_forward_hook(lambda module, args, out: calls.append(module))
    fused_column_linear(torch.randn(2, 16), layers)
    assert calls == layers
