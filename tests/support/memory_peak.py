"""A rank's measured peak memory over a few training steps, next to the planner's prediction for it.

measure_peak runs in a rank (tests/support/ranks.py): it builds the trainer and trains, and reports the
resident memory that added at its highest (the kernel's high-water mark, from just before the
trainer is built: weights, gradients, optimizer states, activations, buffers and whatever the
engine allocates) and the planner's peak for this rank's pipeline stage on this device (CPU), with
its parts. Shared by tests/dist/test_planner_peak.py and tools/peak_table.py."""
from __future__ import annotations

from pathlib import Path

# the model both compare on: 12.9M parameters, seq 256, micro-batch 4, dropout 0.1, fp32
MODEL = ["model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8", "model.ffn_hidden_size=2048",
         "model.seq_length=256", "model.dropout=0.1", "parallel.micro_batch_size=4", "train.max_steps=3",
         "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0", "logging.wandb.mode=disabled",
         "logging.progress_bar=false", "zero.reduce_bucket_size=5000000", "cluster.reserved_gb=0"]
# overrides of MODEL for a Mixture-of-Experts of about its size (Llama flavour, 8 experts of width 512,
# top-2, dropout 0), trained with 2 micro-batches per step at dp=2 as training runs them: the first
# micro-batch's gradients beside the second's activations, the moment the planner's peak describes
MOE = ["model=moe_tiny", "model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8",
       "model.num_kv_heads=8", "model.ffn_hidden_size=2048", "model.moe.ffn_hidden_size=512", "model.dropout=0.0",
       "parallel.global_batch_size=16"]
# overrides of MODEL for a run of almost nothing (2 ranks): what remains is the runtime's own memory
NEAR_EMPTY = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
              "parallel.micro_batch_size=1", "parallel.global_batch_size=2", "parallel.tp=2"]


def runtime_overhead(near_empty: list[dict]) -> float:
    """The runtime's own memory per rank: a near-empty run's measured peak less the planner's figure
    for it (what cluster.reserved_gb stands for in a plan)."""
    return max(r["measured"] - r["planned"] for r in near_empty)


def measure_peak(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    from tests.support.memory_probe import fixed_mmap_threshold, peak_rss

    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer
    from megaframe.model.dims import resolve_dims
    from megaframe.plan.estimate import estimate_stage, plan_layout, planning_vocab_size

    fixed_mmap_threshold()  # freed tensors leave the resident set: measure what is held
    cfg, _ = compose(overrides)
    layout = validate_for_engine(cfg, world, ask_bf16=False)
    with peak_rss() as peak:
        trainer = Trainer(cfg, layout, Path(run_dir))
        trainer.checkpoints.save = lambda step: None  # the steps only: checkpoint memory is measured elsewhere
        with trainer:
            trainer.fit()
    dims = resolve_dims(cfg.model, planning_vocab_size(cfg), tp=layout.tp)
    stage = estimate_stage(dims, plan_layout(cfg, layout), cfg.precision.dtype, trainer.ps.pp_rank, reserved=0.0,
                           host_counts_as_device=True, zero=cfg.zero, device="cpu")
    return {"measured": peak["extra"], "planned": stage.peak, "states": stage.states.device + stage.states.host,
            "activations": stage.activations, "working": stage.working, "stage": trainer.ps.pp_rank}
