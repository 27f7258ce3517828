"""What a few training steps send over a group of ranks, as a ring algorithm sends it, against the plan.

For tests/dist/test_planner_*_traffic.py: each rank trains, records the tensors of every collective
(ProcessGroup's methods, under every collective torch.distributed and DeepSpeed issue) in the steps
after the first, and turns them into what a ring sends: (n-1)/n of the whole tensor for a gather or
a scatter, twice that for an all-reduce."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

GATHERS = ("allgather", "_allgather_base", "all_gather_single", "allgather_into_tensor_coalesced",
           "allgather_coalesced")
SCATTERS = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_coalesced")
REDUCTIONS = ("allreduce", "allreduce_coalesced")
ALL_TO_ALL = ("all_to_all_single", "alltoall_base", "alltoall")
# bytes sent per recorded byte in a group of n: gathers and scatters record input and output, (1 + 1/n)
# of the whole tensor; a reduction records its one tensor, reduced and shared back
RING_SHARE: dict[str, Callable[[int], float]] = {
    **{name: lambda n: (n - 1) / (n + 1) for name in GATHERS + SCATTERS},
    **{name: lambda n: 2 * (n - 1) / n for name in REDUCTIONS},
    # input and output recorded, about equal: a rank keeps 1/n of its input and sends the rest
    **{name: lambda n: (n - 1) / n / 2 for name in ALL_TO_ALL}}


def sent_per_step(overrides: list[str], world: int, run_dir: str, steps: int,
                  groups: Callable[[object], dict[str, list[int]]]) -> tuple[dict[str, float], dict]:
    """Train `steps` steps (the first not counted) and return, for each named group of ranks that
    groups(layout) gives, the bytes a step sent over it, and under "send" those of its point-to-point
    sends (a pipeline's), with the plan's communication for this rank's pipeline stage."""
    import torch

    from tests.support.memory_probe import collective_calls

    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.plan.estimate import communication_bytes, estimate_config, planning_dims
    from megaframe.training.trainer import Trainer

    cfg, _ = compose(overrides)
    layout = validate_for_engine(cfg, world, ask_bf16=False)
    trainer = Trainer(cfg, layout, Path(run_dir))
    trainer.checkpoints.save = lambda step: None
    step, first_counted = trainer.backend.train_step, []
    with collective_calls() as calls:
        def train_step(*args, **kwargs):
            result = step(*args, **kwargs)
            first_counted[:] = first_counted or [len(calls)]  # from the second step on
            return result
        trainer.backend.train_step = train_step
        with trainer:
            trainer.fit()
            counted = calls[first_counted[0]:]
            sent = {name: sum(size * RING_SHARE[op](group.size()) for op, group, size in counted
                              if op in RING_SHARE and torch.distributed.get_process_group_ranks(group) == ranks)
                    / (steps - 1)
                    for name, ranks in groups(layout).items()}
            sent["send"] = sum(size for op, _, size in counted if op == "send") / (steps - 1)
    est = estimate_config(cfg, layout, all_stages=True)  # comm_bytes: the stage with the highest peak's
    own = next(s for s in est.stages if s.stage == trainer.ps.pp_rank)
    return sent, communication_bytes(planning_dims(cfg, layout), est.layout, cfg.precision.dtype, own)
