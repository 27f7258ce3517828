"""The MoE layer on one rank against references written independently of it: a per-token loop
over the chosen experts, the load-balancing and z losses computed from their textbook formulas
(and their gradients by autograd through those formulas), and brute-force index orders."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.model.dims import resolve_dims
from megaframe.model.gpt import GPT, init_parameters
from megaframe.model.moe import AddAux, MoE, _expert_major_order, update_expert_biases
from tests.support.numerics import assert_fp32_close

E, K, H, FFN = 6, 2, 32, 48


def _layer(activation="swiglu", **moe) -> MoE:
    cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=4, activation=activation,
                      moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=FFN, **moe))
    dims = resolve_dims(cfg, 64)
    layer = MoE(dims, GPT(dims).tp)
    init_parameters(layer, "blocks.0.mlp", dims, seed=3)
    return layer


def _reference(layer: MoE, x: torch.Tensor, dropped: set = frozenset()) -> torch.Tensor:
    """Each token through its top-k experts, one at a time (no sorting, no grouped GEMM)."""
    moe = layer.moe
    tokens = x.reshape(-1, H)
    logits = tokens @ layer.router.weight.t()
    scores = logits.softmax(-1) if moe.router_score == "softmax" else logits.sigmoid()
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        chosen = torch.topk(scores[t], moe.top_k).indices
        weights = scores[t, chosen]
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights, chosen.tolist()):
            if (t, e) in dropped:
                continue
            up = tokens[t] @ layer.experts.up_proj[e].t()
            if layer.experts.swiglu:
                hidden = F.silu(tokens[t] @ layer.experts.gate_proj[e].t()) * up
            else:
                hidden = F.gelu(up, approximate="tanh")
            out[t] += w * (hidden @ layer.experts.down_proj[e].t())
    return out.view(x.shape)


def _references(layer: MoE, x: torch.Tensor, dropped: set = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loop in fp64 (on a copy of the layer) and in fp32: the layer's fp32 result
    must lie within a few times the fp32 loop's own rounding (tests/support/numerics.py)."""
    return _reference(copy.deepcopy(layer).double(), x.double(), dropped), _reference(layer, x, dropped)


@pytest.mark.numerics
@pytest.mark.parametrize("activation, moe", [("swiglu", {}), ("gelu", {}), ("swiglu", {"router_score": "sigmoid"}),
                                             ("swiglu", {"norm_topk_prob": False})],
                         ids=["swiglu", "gelu", "sigmoid", "unnormalised"])
def test_dropless_layer_matches_a_per_token_loop(activation, moe):
    layer = _layer(activation, **moe)
    x = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(0))
    references = _references(layer, x)  # before the forward: a copy of the layer takes no activations
    assert_fp32_close(layer(x), *references, f"dropless {activation} {moe}")
    assert layer.stats["dropped"].item() == 0


@pytest.mark.numerics
def test_shared_experts_add_a_dense_mlp_every_token_goes_through():
    """shared_experts=2: an MLP two experts wide (2 x ffn_hidden_size) beside the routed ones."""
    layer = _layer(shared_experts=2)
    assert layer.shared is not None
    x = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(4))
    shared = layer.shared
    tokens = x.reshape(-1, H)
    assert shared.up_proj.weight.shape == (2 * FFN, H)

    def dense(tokens, dtype):  # SwiGLU, written out
        gate, up, down = (getattr(shared, name) for name in ("gate_proj", "up_proj", "down_proj"))
        linear = lambda t, lin: F.linear(t, lin.weight.to(dtype), None if lin.bias is None else lin.bias.to(dtype))
        return linear(F.silu(linear(tokens, gate)) * linear(tokens, up), down)

    ref64, ref32 = _references(layer, x)
    assert_fp32_close(layer(x), ref64 + dense(tokens.double(), torch.float64).view(x.shape),
                      ref32 + dense(tokens, torch.float32).view(x.shape), "shared experts")


@pytest.mark.numerics
def test_the_loop_over_experts_where_no_grouped_gemm_runs_matches_the_per_token_loop(monkeypatch):
    """The path CUDA takes in fp32/fp16 and before Hopper (no torch._grouped_mm): a loop over the
    experts with their row counts read once per layer, forward and gradients."""
    from megaframe.model import moe as moe_module

    layer = _layer()
    x = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    want, want64 = _reference(layer, x), _reference(copy.deepcopy(layer).double(), x64)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    (want_grad64,) = torch.autograd.grad(want64.square().sum(), x64)
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(moe_module, "_grouped_mm_works", lambda *args: False)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    got = layer(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    assert reads == [torch.Size([E])], reads  # the counts, once for the three projections
    assert_fp32_close(got, want64.detach(), want.detach(), "expert loop output")
    assert_fp32_close(got_grad, want_grad64, want_grad, "expert loop input gradient")


def test_a_capacitys_fixed_slots_are_not_read_back_by_the_expert_loop(monkeypatch):
    """Under a capacity factor every expert computes the same fixed number of slots, known on the host;
    the loop over experts (fp32/fp16 on CUDA, bf16 before Hopper) read them back from the device once
    per layer and micro-batch all the same."""
    from megaframe.model import moe as moe_module

    layer = _layer(capacity_factor=1.0)
    x = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    want = layer(x)
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(moe_module, "_grouped_mm_works", lambda *args: False)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    got = layer(x)
    torch.autograd.grad(got.square().sum(), x)
    assert reads == [], reads
    torch.testing.assert_close(got, want)


@pytest.mark.numerics
def test_capacity_drops_the_later_tokens_of_a_full_expert():
    layer = _layer(capacity_factor=0.5)
    x = torch.randn(1, 12, H, generator=torch.Generator().manual_seed(1))
    fp64_layer = copy.deepcopy(layer).double()  # before the forward: a copy takes no activations
    y = layer(x)
    # capacity: ceil(12 tokens * 2 / 6 experts * 0.5) = 2 assignments per expert, first in token order
    with torch.no_grad():
        chosen = torch.topk((x.reshape(-1, H) @ layer.router.weight.t()).softmax(-1), K).indices
    taken, dropped = {}, set()
    for t in range(12):
        for e in chosen[t].tolist():
            taken[e] = taken.get(e, 0) + 1
            if taken[e] > 2:
                dropped.add((t, e))
    assert dropped, "the test input should overflow some expert"
    assert layer.stats["dropped"].item() == len(dropped)
    assert_fp32_close(y, _reference(fp64_layer, x.double(), dropped), _reference(layer, x, dropped), "capacity drops")


def test_a_capacity_nobody_reaches_changes_nothing():
    layer = _layer()
    x = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(2))
    dropless = layer(x)
    layer.moe = dataclasses.replace(layer.moe, capacity_factor=float(E))
    torch.testing.assert_close(layer(x), dropless, rtol=1e-6, atol=1e-7)
    # a factor past what an expert can receive (every token of the rank) holds buffers of the tokens,
    # not of the factor: 1e9 asked for a petabyte at step 0 (feature review)
    from megaframe.model.dims import capacity_slots

    assert capacity_slots(20, K, E, 1e9) == 20
    layer.moe = dataclasses.replace(layer.moe, capacity_factor=1e9)
    torch.testing.assert_close(layer(x), dropless, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_losses_and_their_gradient_match_the_formulas(score):
    aux_coeff, z_coeff = 0.05, 0.002
    layer = _layer(router_score=score, aux_loss_coeff=aux_coeff, z_loss_coeff=z_coeff)
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(4))
    layer(x)
    (grad,) = torch.autograd.grad(layer.aux_loss, layer.router.weight)

    # Switch Transformer / GShard: E * sum_i f_i * P_i, f_i the fraction of the N*k assignments that
    # went to expert i, P_i the mean over tokens of its (normalised) probability; ST-MoE's z-loss
    weight = layer.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, H) @ weight.t()
    n = logits.shape[0]
    raw = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    probs = raw / raw.sum(-1, keepdim=True)
    chosen = torch.topk(raw, K).indices
    fraction = torch.zeros(E)
    for t in range(n):
        for e in chosen[t].tolist():
            fraction[e] += 1.0 / (n * K)
    aux = aux_coeff * E * sum(fraction[i] * probs[:, i].mean() for i in range(E))
    z = z_coeff * sum(torch.logsumexp(logits[t], 0) ** 2 for t in range(n)) / n
    (expected_grad,) = torch.autograd.grad(aux + z, weight)
    torch.testing.assert_close(layer.aux_loss, aux + z, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-8)
    assert layer.stats["counts"].sum().item() == n * K


def test_add_aux_keeps_the_value_and_passes_the_gradient_on():
    loss, aux = torch.tensor(2.0, requires_grad=True), torch.tensor(0.5, requires_grad=True)
    out = AddAux.apply(loss, aux)
    assert out.item() == 2.0
    (3 * out).backward()
    assert loss.grad.item() == 3.0 and aux.grad.item() == 3.0


def test_expert_major_order_regroups_blocks_as_brute_force_does():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source rank][local expert]
    rows, labels = 0, []
    for source in range(2):
        for expert in range(3):
            labels += [(expert, source, j) for j in range(int(counts[source, expert]))]
            rows += int(counts[source, expert])
    order = _expert_major_order(counts, rows)
    assert [labels[i] for i in order.tolist()] == sorted(labels)


def test_bias_balancing_raises_the_bias_of_underused_experts_only_on_applied_steps():
    layer = _layer(bias_update_rate=0.01, aux_loss_coeff=0.0)
    layer.train()
    layer(torch.randn(2, 10, H, generator=torch.Generator().manual_seed(5)))
    load = layer.step_counts.float()
    update_expert_biases([layer], 1, layer.moe, "cpu", apply=False)
    assert torch.all(layer.router.expert_bias == 0) and layer.step_counts is None
    layer(torch.randn(2, 10, H, generator=torch.Generator().manual_seed(5)))
    update_expert_biases([layer], 1, layer.moe, "cpu")
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(layer.router.expert_bias, expected)


def test_model_loss_value_is_the_language_model_loss():
    cfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, moe=MoEConfig(num_experts=E, top_k=K))
    dims = resolve_dims(cfg, 64)
    moe_model = GPT(dims)
    init_parameters(moe_model, "", dims, seed=1)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(6))
    logits = moe_model.logits(idx)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1))
    torch.testing.assert_close(moe_model(idx[:, :-1], idx[:, 1:]), expected, rtol=1e-5, atol=1e-6)


def test_recomputation_leaves_the_forwards_records_alone():
    """Under activation checkpointing each block's forward runs again inside backward. The MoE
    layers' records are the forward's: the aux loss attached to the loss (a recomputed one, kept
    with its graph, would hold the whole recomputed block until the next step), the router
    statistics, and the expert counts bias balancing adds up (not counted twice). Gradients equal
    the run without recomputation."""
    cfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4,
                      moe=MoEConfig(num_experts=E, top_k=K, ffn_hidden_size=FFN, bias_update_rate=0.01))
    dims = resolve_dims(cfg, 64)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
    grads = []
    for recompute in (False, True):
        model = GPT(dims, activation_checkpointing=recompute)
        init_parameters(model, "", dims, seed=1)
        model.train()
        loss = model(idx, idx)
        records = [(layer.aux_loss, layer.stats) for layer in model.moe_layers]
        loss.backward()
        for layer, (aux_loss, stats) in zip(model.moe_layers, records):
            assert layer.aux_loss is aux_loss and layer.stats is stats
            assert layer.step_counts.sum().item() == idx.numel() * K
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_routing_runs_no_kernel_that_waits_for_the_host():
    """CUDA's bincount reads min and max to the host: counting the experts' assignments with it
    stalled the stream twice per MoE layer and micro-batch. Forward and backward of a layer at
    ep=1 with a grouped GEMM run none of the kernels that sync inside (tests/support/kernel_syncs.py)."""
    from tests.support.kernel_syncs import KernelSyncs

    layer = _layer()
    x = torch.randn(2, 10, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    with KernelSyncs() as syncs:
        layer(x).square().sum().backward()
    assert not syncs.counts, dict(syncs.counts)


def test_the_kernel_sync_counter_sees_bincount():
    """The counter above can fail: the kernel it replaced is counted."""
    from tests.support.kernel_syncs import KernelSyncs

    with KernelSyncs() as syncs:
        torch.bincount(torch.tensor([0, 2, 2]), minlength=4)
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]))
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]), output_size=3)  # sized: no read
    assert syncs.counts == {"aten::bincount": 1, "aten::repeat_interleave": 1}, dict(syncs.counts)


def test_the_grouped_gemm_gate_asks_for_what_the_cuda_kernel_needs(monkeypatch):
    """On CUDA, torch._grouped_mm runs one kernel for bf16 on sm90 and sm100 with operand strides of
    16 bytes: widths that are multiples of 8 in bf16. It takes bf16 from sm80, but there it falls back
    to a loop that reads the offsets to the host at every grouped GEMM (about 9 a layer and
    micro-batch, against the experts' own loop's one). Elsewhere the experts loop (the gate is asked
    on a meta tensor posing as CUDA; the CPU kernel takes anything)."""
    from megaframe.model import moe as moe_module

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    def like(dtype, width=64):
        return torch.empty(4, width, dtype=dtype, device="meta").as_subclass(OnCuda)

    for capability, dtype, widths, works in [((9, 0), torch.bfloat16, (96, 64), True),
                                             ((10, 0), torch.bfloat16, (96, 64), True),
                                             ((8, 0), torch.bfloat16, (96, 64), False),
                                             ((12, 0), torch.bfloat16, (96, 64), False),
                                             ((7, 5), torch.bfloat16, (96, 64), False),
                                             ((9, 0), torch.float32, (96, 64), False),
                                             ((9, 0), torch.bfloat16, (100, 64), False),
                                             ((9, 0), torch.bfloat16, (96, 60), False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert moe_module._grouped_mm_works(like(dtype, widths[1]), *widths) is works, (capability, dtype, widths)
    assert moe_module._grouped_mm_works(torch.empty(4, 60), 100, 60)  # the CPU kernel: 16-byte strides too
    assert not moe_module._grouped_mm_works(torch.empty(4, 60), 34, 60)  # 136 bytes
    assert not moe_module._grouped_mm_works(torch.empty(4, 36, dtype=torch.bfloat16), 64, 36)  # 72 bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_expert_width_off_16_bytes_loops_on_the_cpu(dtype):
    """model.moe.ffn_hidden_size=34 (or 36 in bf16) was "strides should be multiple of 16 bytes" at step 0."""
    from megaframe.model.moe import grouped_linear

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(10, 34, generator=generator).to(dtype)
    weight = torch.randn(3, 36, 34, generator=generator).to(dtype)
    counts = torch.tensor([4, 0, 6])
    got = grouped_linear(x, weight, counts)
    want = torch.cat([x[:4] @ weight[0].T, x[4:] @ weight[2].T])
    torch.testing.assert_close(got, want)
