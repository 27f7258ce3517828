"""`megaframe-eval CKPT [OVERRIDE ...]`: the loss and perplexity of a checkpoint on a dataset.

CKPT is a layout-free checkpoint directory or a run's checkpoints/ directory (its `latest`), written
in any layout by either engine. The samples are those a training run evaluates: the first
train.eval_steps global batches (parallel.global_batch_size) of the validation set, which is
data.valid_path when set, else the held-out data.valid_fraction of data.path (or of the demo corpus).
So on the run's own data and batch settings the figure is the run's eval_loss at that step.

The model (its shape and sequence length) comes from the checkpoint; the overrides take data.*,
train.eval_steps, parallel.micro_batch_size and parallel.global_batch_size. It runs in one process
on the GPU when there is one, else the CPU, holding the whole model: a model larger than one device
is evaluated by a training run's eval (train.eval_interval) instead.

Bad input ends with one line `megaframe-eval: error: ...` and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

PROG = "megaframe-eval"
ALLOWED = ("data.", "train.eval_steps=", "parallel.micro_batch_size=", "parallel.global_batch_size=")


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def evaluate(checkpoint: Path, overrides: Sequence[str]) -> dict:
    """{"checkpoint", "samples", "tokens_per_sample", "loss", "perplexity", "data"}; raises
    ValueError (ConfigError, ConvertError, DataError) with one line on bad input."""
    import torch

    from megaframe.config.compose import compose
    from megaframe.config.validate import ConfigError
    from megaframe.convert.files import resolve_checkpoint
    from megaframe.data import DataError, eval_batches
    from megaframe.data.dataset import eval_wrap_problem
    from megaframe.load import load_model
    from megaframe.training.data_setup import build_data

    for override in overrides:
        if not override.startswith(ALLOWED):
            raise ConfigError(f"{override.split('=', 1)[0]}: the model comes from the checkpoint; {PROG} takes "
                              f"data.*, train.eval_steps, parallel.micro_batch_size and parallel.global_batch_size")
    cfg, _ = compose(list(overrides))
    batch, micro = cfg.parallel.global_batch_size, cfg.parallel.micro_batch_size
    if micro < 1 or batch % micro:
        raise ConfigError(f"parallel.global_batch_size={batch} must be a multiple of parallel.micro_batch_size={micro}")
    if cfg.train.eval_steps < 1:
        raise ConfigError(f"train.eval_steps={cfg.train.eval_steps} must be >= 1")
    path = resolve_checkpoint(checkpoint)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(path, device)
    data = build_data(cfg.data, model.dims.seq_length)
    if data.valid is None:
        raise DataError("data.valid_fraction=0 leaves no validation set to evaluate; set data.valid_fraction > 0 "
                        "or data.valid_path=PREFIX")
    if data.vocab_size > model.dims.vocab_size:
        raise DataError(f"the dataset's vocabulary ({data.vocab_size}) is larger than the checkpoint's model's "
                        f"({model.dims.vocab_size}): it was tokenized for another model; check data.tokenizer")
    samples = cfg.train.eval_steps * batch
    if problem := eval_wrap_problem(cfg.train.eval_steps, batch, len(data.valid)):
        print(f"{PROG}: warning: {problem}", file=sys.stderr, flush=True)
    total = torch.zeros((), dtype=torch.float64, device=device)
    batches = eval_batches(data.valid, cfg.train.eval_steps * (batch // micro), micro, 0, 1)
    with torch.no_grad():
        for inputs, targets in batches:  # each micro-batch's mean, as the trainer's evaluate() takes them
            total += model(inputs.to(device), targets.to(device)).double()
    loss = (total / len(batches)).item()
    where = cfg.data.valid_path or (f"held-out part of {cfg.data.path}" if cfg.data.path else "demo corpus's held-out part")
    return {"checkpoint": str(path), "samples": samples, "tokens_per_sample": model.dims.seq_length, "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else float("inf"), "data": where}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("checkpoint", type=Path, help="a layout-free checkpoint, or a run's checkpoints/ directory")
    parser.add_argument("overrides", nargs="*", help="data.*, train.eval_steps, parallel.micro_batch_size, "
                                                      "parallel.global_batch_size")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        result = evaluate(args.checkpoint, args.overrides)
    except ValueError as err:  # ConfigError, ConvertError, DataError: one line each
        _fail(str(err))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{PROG}: {result['checkpoint']}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over "
          f"{result['samples']} samples of {result['tokens_per_sample']} tokens ({result['data']})")


if __name__ == "__main__":
    main()
