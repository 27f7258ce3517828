"""train.compile: blocks compiled in place train the same model as the eager ones."""
from __future__ import annotations

import torch

from megaframe.model.factory import build_model, compile_blocks, resolve_dims
from tests.support.numerics import assert_fp32_close
from tests.unit.model.test_gpt import LLAMA, ONE_RANK


def test_compiled_blocks_give_eager_loss_and_gradients():
    """llama: RMSNorm, RoPE, SwiGLU and GQA in one graph. One flavour, since a cold compile costs
    about 50 s on CI's machine; gpt2 compiled under tp=2 with SP is in tests/dist/test_tensor_parallel.py."""
    cfg = LLAMA
    dims = resolve_dims(cfg, 100)
    eager, compiled = build_model(dims, ONE_RANK, seed=7), build_model(dims, ONE_RANK, seed=7)
    assert compile_blocks(compiled) == cfg.num_layers
    # in place: names (and so checkpoints, HF export, the optimizer's groups) are the eager ones
    assert list(compiled.state_dict()) == list(eager.state_dict())
    ids = torch.randint(0, 100, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    eager64 = build_model(dims, ONE_RANK, seed=7).double()  # the rounding-free answer
    for model in (eager, compiled, eager64):
        for _ in range(2):  # the second call runs the cached graph
            model.zero_grad(set_to_none=True)
            model(ids[:, :-1], ids[:, 1:]).backward()
    losses = [model(ids[:, :-1], ids[:, 1:]).detach() for model in (eager, compiled, eager64)]
    # inductor fuses and reorders reductions (norms, softmax) differently on each host's ISA: the
    # compiled fp32 values must lie within a few times eager fp32's own rounding (tests/support/numerics.py)
    assert_fp32_close(losses[1], losses[2], losses[0], "compiled loss")
    for (name, p_eager), p_compiled, p64 in zip(eager.named_parameters(), compiled.parameters(), eager64.parameters()):
        assert_fp32_close(p_compiled.grad, p64.grad, p_eager.grad, f"compiled grad {name}")
    # proof the compiled path ran: dynamo wrapped each block's forward, and the head with the loss
    assert all(block._compiled_call_impl is not None for block in compiled.blocks)
    assert getattr(compiled.head_loss, "_torchdynamo_orig_callable", None) is not None
    assert "head_loss" not in vars(eager)


def test_the_model_scope_wraps_the_whole_forward_in_place():
    """train.compile_scope=model: one graph over the GPT's forward (compiled lazily, at the first call:
    its numbers are held to the single rank's in tests/dist/test_tensor_parallel.py), names unchanged."""
    from megaframe.model.factory import compile_model

    dims = resolve_dims(LLAMA, 100)
    model = build_model(dims, ONE_RANK, seed=7)
    names = list(model.state_dict())
    assert compile_model(model, "model") == LLAMA.num_layers
    assert model._compiled_call_impl is not None and list(model.state_dict()) == names
    assert all(block._compiled_call_impl is None for block in model.blocks)  # not graphs of their own
