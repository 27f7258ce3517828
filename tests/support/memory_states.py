"""The measurement behind tests/dist/test_memory_states.py and tools/memory_table.py: the model
states DeepSpeed holds per rank, mid-step, for each ZeRO stage (a harness, not library code)."""
from __future__ import annotations

# The model the memory test and BENCHMARKS.md measure: big enough that fixed overheads vanish
# (~1.2M parameters), small enough for four ranks on two cores.
MEASURE_OVERRIDES = ["model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4",
                     "model.seq_length=32", "parallel.micro_batch_size=2", "train.eval_interval=0",
                     "logging.wandb.mode=disabled", "logging.progress_bar=false",
                     "zero.stage3_param_persistence_threshold=0"]  # else ZeRO-3 keeps small weights whole


def measure_zero_stages(rank: int, world: int, run_root: str, stages=(0, 1, 2, 3), dtype: str = "bf16") -> list[dict]:
    """In a set of `world` data-parallel ranks, train one step per ZeRO stage, then hold this rank's
    model states in the middle of the next step (after a non-final micro-batch's backward, where
    ZeRO-0/1 keep whole gradients) and return held_model_states() with Ψ (whole-model parameters)."""
    from pathlib import Path

    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.backends.deepspeed.memory import held_model_states
    from megaframe.data import micro_batches
    from megaframe.training.trainer import Trainer

    results = []
    for stage in stages:
        overrides = [*MEASURE_OVERRIDES, f"zero=stage{stage}", f"precision={dtype}",
                     f"parallel.global_batch_size={2 * 2 * world}"]  # 2 micro-batches per step
        cfg, _ = compose(overrides)
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_root) / f"stage{stage}") as trainer:
            trainer.train_step()
            (inputs, targets), _ = micro_batches(trainer.data.train, 1, cfg.parallel.global_batch_size,
                                                 cfg.parallel.micro_batch_size, trainer.ps.dp_rank, world,
                                                 cfg.train.seed)
            engine = trainer.backend.engine
            engine.backward(engine(inputs, targets))
            results.append({"stage": stage, "dp": world, "psi": trainer.num_parameters, "dtype": dtype,
                            **held_model_states(engine)})
    return results


# moe_tiny at hidden 128: its 8 experts are most of its weights
MOE_OVERRIDES = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=128", "model.seq_length=32",
                 "parallel.dp=2", "parallel.micro_batch_size=2", "parallel.global_batch_size=8", "precision=bf16",
                 "train.eval_interval=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def measure_moe_states(rank: int, world: int, run_root: str, cases: tuple[tuple[int, int], ...]) -> list[dict]:
    """For each (ep, ZeRO stage) in cases, in a set of `world` data-parallel ranks: one step of
    moe_tiny (bf16), then this rank's held model states mid-step next to the planner's, and the
    process groups ZeRO-3 partitions the experts over."""
    from pathlib import Path

    import torch.distributed as dist

    from megaframe.backends.deepspeed.memory import held_model_states
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.data import micro_batches
    from megaframe.training.trainer import Trainer
    from megaframe.plan.estimate import estimate_config

    results = []
    for ep, stage in cases:
        cfg, _ = compose([*MOE_OVERRIDES, f"parallel.dp={world}", f"parallel.global_batch_size={4 * world}",
                          f"parallel.ep={ep}", f"zero=stage{stage}",
                          "zero.stage3_param_persistence_threshold=0"])  # else ZeRO-3 keeps small weights whole
        layout = validate_for_engine(cfg, world, ask_bf16=False)
        with Trainer(cfg, layout, Path(run_root) / f"ep{ep}-zero{stage}") as trainer:
            trainer.train_step()
            (inputs, targets), _ = micro_batches(trainer.data.train, 1, cfg.parallel.global_batch_size,
                                                 cfg.parallel.micro_batch_size, trainer.ps.dp_rank, world,
                                                 cfg.train.seed)
            engine = trainer.backend.engine
            engine.backward(engine(inputs, targets))  # mid-step: a non-final micro-batch's gradients held
            planned = estimate_config(cfg, layout).stages[0].states
            expert_groups = {tuple(dist.get_process_group_ranks(p.ds_process_group))
                             for p in engine.module.parameters() if getattr(p, "allreduce", True) is False
                             and hasattr(p, "ds_process_group")}
            results.append({"ep": ep, "stage": stage, **held_model_states(engine),
                            "expert_partition_groups": sorted(expert_groups),
                            "edp_ranks": trainer.ps.group_ranks("edp"),
                            "planned_weights": planned.weights, "planned_optimizer": planned.optimizer,
                            "planned_gradients": planned.gradients})
    return results
