"""Measure the pipeline bubble: pp=4 stages, m micro-batches, 1F1B on DeepSpeed's pipeline engine.

usage: python tools/bench_pipeline.py [--micro-batches 4 8 16] [--steps 6] [--out bubble.json]

Each stage's busy time is the time spent in its forward and backward passes (DeepSpeed's
ForwardPass / BackwardPass instructions); its idle fraction is 1 - busy / step time. The table
puts the mean over stages next to the 1F1B theory (p-1)/(m+p-1). Runs the 4 ranks itself.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STAGES = 4
# one 256-wide block per stage, so each stage carries the same compute
MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.ffn_hidden_size=1024",
         "model.seq_length=128", "parallel.micro_batch_size=2", "zero=stage1", "train.eval_interval=0",
         "logging.wandb.mode=disabled", "logging.progress_bar=false", f"parallel.pp={STAGES}"]


def _measure(micro_batches: int, steps: int) -> dict:
    """In one rank: train `steps` steps with m micro-batches; return this stage's busy/step seconds."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from megaframe.config.compose import compose
    from megaframe.config.validate import validate
    from megaframe.training.trainer import Trainer

    cfg, _ = compose([*MODEL, f"parallel.global_batch_size={2 * micro_batches}", f"train.max_steps={steps}"])
    trainer = Trainer(cfg, validate(cfg, STAGES, lambda: False), Path(os.environ["BENCH_RUN_DIR"]))
    busy = [0.0]
    for instruction in (schedule.ForwardPass, schedule.BackwardPass):
        original = PipelineEngine._INSTRUCTION_MAP[instruction]

        def timed(self, *args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start
        PipelineEngine._INSTRUCTION_MAP[instruction] = timed
    warmup = 2
    step_time = 0.0
    for step in range(steps):
        if step == warmup:
            busy[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        if step >= warmup:
            step_time += time.perf_counter() - start
    trainer.close()
    return {"stage": trainer.ps.pp_rank, "busy_s": busy[0], "step_s": step_time}


def _worker(args) -> None:
    import torch.distributed as dist

    from megaframe.backends.deepspeed.engine import init_distributed

    init_distributed()
    rows = []
    for m in args.micro_batches:
        mine = _measure(m, args.steps)
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, mine)
        idle = [1 - s["busy_s"] / s["step_s"] for s in stages]
        rows.append({"stages": STAGES, "micro_batches": m, "measured_idle": sum(idle) / len(idle),
                     "idle_per_stage": idle, "theory_idle": (STAGES - 1) / (m + STAGES - 1),
                     "step_s": max(s["step_s"] for s in stages) / (args.steps - 2)})
    if dist.get_rank() == 0:
        print("| p | m | measured idle (mean of stages) | per stage | 1F1B theory (p-1)/(m+p-1) | s/step |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            per = " ".join(f"{x:.2f}" for x in r["idle_per_stage"])
            print(f"| {r['stages']} | {r['micro_batches']} | {r['measured_idle']:.1%} | {per} | "
                  f"{r['theory_idle']:.1%} | {r['step_s']:.2f} |")
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=6, help="steps per setting; the first 2 are warm-up")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (2 warm-up steps are not measured)")
    if args.worker:
        _worker(args)
        return
    import tempfile

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               BENCH_RUN_DIR=tempfile.mkdtemp(prefix="megaframe-bubble-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={STAGES}",
           __file__, "--worker", "--steps", str(args.steps), "--micro-batches", *map(str, args.micro_batches)]
    if args.out:
        cmd += ["--out", str(Path(args.out).resolve())]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
