"""ensure_state at a save: the step counts are left alone when they agree (a new count on the device was
a blocking upload per parameter), and all set to the checkpoint's one count when they do not, so the
run goes on as a resume from that checkpoint would."""
from __future__ import annotations

import torch

from megaframe.optim.state import ensure_state


def _adamw_after(steps_with_grad: list[bool]) -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    """AdamW over two parameters, stepped len(steps) times; the second has no gradient where False."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for with_grad in steps_with_grad:
        params[0].grad = torch.ones(3)
        params[1].grad = torch.ones(2) if with_grad else None
        optimizer.step()
    return optimizer, params


def test_a_save_keeps_agreeing_step_counts_as_they_are():
    optimizer, params = _adamw_after([True, True])
    before = [optimizer.state[p]["step"] for p in params]
    ensure_state(optimizer, 2, reset_steps=False)
    assert all(optimizer.state[p]["step"] is count for p, count in zip(params, before))
    assert [float(optimizer.state[p]["step"]) for p in params] == [2.0, 2.0]


def test_a_save_sets_disagreeing_counts_to_the_checkpoints_one_count():
    optimizer, params = _adamw_after([True, False, True])  # the second parameter missed a step
    assert [float(optimizer.state[p]["step"]) for p in params] == [3.0, 2.0]
    ensure_state(optimizer, 3, reset_steps=False)
    assert [float(optimizer.state[p]["step"]) for p in params] == [3.0, 3.0]


def test_a_save_makes_the_missing_state_of_a_parameter_never_stepped():
    optimizer, params = _adamw_after([False])  # the second parameter has no state at all
    assert "step" not in optimizer.state[params[1]]
    ensure_state(optimizer, 1, reset_steps=False)
    assert float(optimizer.state[params[1]]["step"]) == 1.0
    assert torch.equal(optimizer.state[params[1]]["exp_avg"], torch.zeros(2))


def test_a_resume_sets_every_count():
    optimizer, params = _adamw_after([True, True])
    ensure_state(optimizer, 7)
    assert [float(optimizer.state[p]["step"]) for p in params] == [7.0, 7.0]
