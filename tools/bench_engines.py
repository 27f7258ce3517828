"""Step time of the same model and layout on DeepSpeed ZeRO-3 and on FSDP2 (zero=stage3), in one run.

usage: torchrun --standalone --nproc_per_node=2 tools/bench_engines.py [--steps 10] [--repeats 3]
                                                                        [--warmup 3] [OVERRIDE ...]

Both engines train in the same ranks, one after the other in interleaved rounds (DeepSpeed, FSDP2,
DeepSpeed, ...), each round timing --steps optimizer steps after --warmup untimed ones; rank 0 prints
each engine's median seconds per step and the ratio FSDP2 / DeepSpeed (below 1: FSDP2 faster).
Default shape: tools/bench.py's tiny one (4 layers, hidden 256, seq 128) at dp = the world size.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import megaframe  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
from bench import COMMON, SHAPES  # noqa: E402

ENGINES = {"deepspeed": ["zero=stage3"], "fsdp2": ["backend=fsdp2", "zero=stage3"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import torch.distributed as dist

    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.training.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps_needed = args.repeats * (args.warmup + args.steps)
    trainers = {}
    for name, engine_keys in ENGINES.items():
        cfg, _ = compose([*COMMON, *SHAPES["tiny"], *engine_keys, f"train.max_steps={steps_needed}", *args.overrides])
        run_dir = Path(tempfile.mkdtemp(prefix=f"bench-engines-{name}-"))
        trainers[name] = Trainer(cfg, validate_for_engine(cfg, world), run_dir).__enter__()
    seconds: dict[str, list[float]] = {name: [] for name in ENGINES}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            for _ in range(args.warmup):
                trainer.train_step()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            dist.barrier()
            seconds[name].append((time.perf_counter() - start) / args.steps)
    if dist.get_rank() == 0:
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        for name, values in seconds.items():
            print(f"{name:10s} median {medians[name] * 1000:8.1f} ms/step  rounds " +
                  " ".join(f"{v * 1000:.1f}" for v in values))
        print(f"fsdp2 / deepspeed step time: {medians['fsdp2'] / medians['deepspeed']:.3f} (dp={world}, zero=stage3)")
    for trainer in trainers.values():
        trainer.__exit__(None, None, None)


if __name__ == "__main__":
    main()
