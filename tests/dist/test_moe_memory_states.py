"""Expert parallelism's memory, measured: the model states DeepSpeed holds on a rank mid-step (bf16,
ZeRO-1 and ZeRO-2, dp=2) equal the planner's, which partitions dense parameters over dp x cp and
each rank's experts over their expert-data-parallel replicas, at ep=1 and at ep=2 (half the
experts per rank, their optimizer states then partitioned over no one)."""
from __future__ import annotations

import pytest

from ranks import run_ranks

pytestmark = pytest.mark.slow
OVERRIDES = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=128", "model.seq_length=32",
             "parallel.dp=2", "parallel.micro_batch_size=2", "parallel.global_batch_size=8", "precision=bf16",
             "train.eval_interval=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def _measure(rank: int, world: int, run_root: str) -> list[dict]:
    from pathlib import Path

    from megaframe.backends.deepspeed.memory import held_model_states
    from megaframe.config.compose import compose
    from megaframe.config.validate import validate
    from megaframe.data import micro_batches
    from megaframe.engine.trainer import Trainer
    from megaframe.plan.estimate import estimate_config

    results = []
    for ep in (1, 2):
        for stage in (1, 2):
            cfg, _ = compose([*OVERRIDES, f"parallel.ep={ep}", f"zero=stage{stage}"])
            layout = validate(cfg, world)
            with Trainer(cfg, layout, Path(run_root) / f"ep{ep}-zero{stage}") as trainer:
                trainer.train_step()
                (inputs, targets), _ = micro_batches(trainer.data.train, 1, cfg.parallel.global_batch_size,
                                                     cfg.parallel.micro_batch_size, trainer.ps.dp_rank, world,
                                                     cfg.train.seed)
                engine = trainer.backend.engine
                engine.backward(engine(inputs, targets))  # mid-step: a non-final micro-batch's gradients held
                planned = estimate_config(cfg, layout).stages[0].states
                results.append({"ep": ep, "stage": stage, **held_model_states(engine),
                                "planned_weights": planned.weights, "planned_optimizer": planned.optimizer,
                                "planned_gradients": planned.gradients})
    return results


def test_held_states_with_experts_split_match_the_planner(tmp_path):
    results = run_ranks(_measure, 2, tmp_path, timeout=900, run_root=str(tmp_path / "runs"))
    for rank_results in results:
        by = {(r["ep"], r["stage"]): r for r in rank_results}
        for r in rank_results:
            what = f"ep={r['ep']} ZeRO-{r['stage']}: {r}"
            assert r["weights"] == pytest.approx(r["planned_weights"], rel=0.01), what
            assert r["optimizer"] == pytest.approx(r["planned_optimizer"], rel=0.05), what
            assert r["weights"] + r["gradients"] + r["optimizer"] == pytest.approx(
                r["planned_weights"] + r["planned_gradients"] + r["planned_optimizer"], rel=0.05), what
        # ep=2 holds half the experts' weights; the experts are most of moe_tiny's weights
        assert by[(2, 1)]["weights"] < 0.75 * by[(1, 1)]["weights"]
