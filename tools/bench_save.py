"""How long a checkpoint save stalls the training loop, synchronous against train.async_save=true.

usage: python tools/bench_save.py [--saves 3] [OVERRIDE ...]

Builds the trainer in this process (one rank), trains a step between saves, and times the call
that saves: a synchronous save returns once the checkpoint is published; an async one once the
rank has queued the copies of its shard to host memory and its writer thread has taken over (the
time until the checkpoint is published is reported too). On a GPU those copies run on the step
loop's stream, so the step after an async save also waits for them: its time beyond a step after
no save ("next step +") is part of what the save costs the run.
"""
from __future__ import annotations

import argparse
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

# ~50M parameters: enough bytes that writing them dominates a save
SHAPE = ["model.num_layers=12", "model.hidden_size=576", "model.num_attention_heads=8", "model.ffn_hidden_size=2304",
         "model.seq_length=64",
         "parallel.micro_batch_size=2", "parallel.global_batch_size=2", "train.eval_interval=0",
         "train.save_interval=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]


def _timed_step(trainer) -> float:
    """One training step's seconds, its device work included (it reads its loss back)."""
    start = time.perf_counter()
    result, _ = trainer.train_step()
    float(result.loss)
    return time.perf_counter() - start


def measure(overrides: list[str], saves: int, async_save: bool) -> tuple[list[float], list[float], int, list[float]]:
    """(stall per save, write time per save, bytes per checkpoint, the next step's time beyond a plain step's)."""
    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.training.trainer import Trainer

    cfg, _ = compose([*SHAPE, *overrides, f"train.async_save={str(async_save).lower()}", "train.max_steps=100"])
    stalls, writes, extra = [], [], []
    # the launch's checks (the engine's and optimizer's rules); the checkpoints go with the folder
    with tempfile.TemporaryDirectory(prefix="megaframe-bench-save-") as run_dir, \
            Trainer(cfg, validate_for_engine(cfg, 1), Path(run_dir)) as trainer:
        trainer.train_step()
        for _ in range(saves):
            plain = _timed_step(trainer)  # a step after no save
            start = time.perf_counter()
            trainer.checkpoints.save(trainer.step)
            stalls.append(time.perf_counter() - start)
            extra.append(_timed_step(trainer) - plain)  # the step after the save (the writer may still run)
            trainer.checkpoints.wait()
            writes.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in trainer.last_checkpoint.rglob("*") if f.is_file())
        params = trainer.num_parameters
    print(f"{'async' if async_save else 'sync '}: {params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB per checkpoint; "
          f"stall per save {', '.join(f'{s:.2f}' for s in stalls)} s; until published "
          f"{', '.join(f'{w:.2f}' for w in writes)} s; next step + {', '.join(f'{e:+.2f}' for e in extra)} s",
          flush=True)
    return stalls, writes, size, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {mode: measure(args.overrides, args.saves, mode == "async") for mode in ("sync", "async")}
    print("| save | stall per save (median) | next step + (median) | until published (median) | MiB per checkpoint |")
    print("|---|---|---|---|---|")
    for mode, (stalls, writes, size, extra) in results.items():
        print(f"| {mode} | {statistics.median(stalls):.2f} s | {statistics.median(extra):+.2f} s | "
              f"{statistics.median(writes):.2f} s | {size / 2**20:.0f} |")


if __name__ == "__main__":
    main()
