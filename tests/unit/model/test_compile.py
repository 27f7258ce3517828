"""train.compile: blocks compiled in place train the same model as the eager ones."""
from __future__ import annotations

import torch

from megaframe.model.factory import build_model, compile_blocks, resolve_dims
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
    for model in (eager, compiled):
        for _ in range(2):  # the second call runs the cached graph
            model.zero_grad(set_to_none=True)
            model(ids[:, :-1], ids[:, 1:]).backward()
    loss_eager, loss_compiled = eager(ids[:, :-1], ids[:, 1:]), compiled(ids[:, :-1], ids[:, 1:])
    # inductor fuses and reorders reductions (norms, softmax): ~1e-7 on the loss; gradients of small
    # magnitude see larger relative error, hence rtol 1e-4 with atol 1e-6 there
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-5)
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-4, atol=1e-6, msg=name)
    # proof the compiled path ran: dynamo wrapped each block's forward
    assert all(block._compiled_call_impl is not None for block in compiled.blocks)
