"""`megaframe-eval CKPT [OVERRIDE ...]`: the loss, perplexity and bits of a checkpoint on a dataset.

CKPT is a layout-free checkpoint directory or a run's checkpoints/ directory (its `latest`), written
in any layout by either engine. By default the data is the run's own: its data.*, tokenizer,
train.eval_steps and batch sizes come from the config the run saved beside its checkpoints
(RUN_DIR/config.yaml), so the figure is the run's own eval_loss at that step. When that file or the
data it names is gone, the command says so in one line (exit 2) rather than scoring other data.
The samples are those a training run evaluates: the first train.eval_steps global batches
(parallel.global_batch_size) of the validation set (data.valid_path when set, else the held-out
data.valid_fraction of data.path or of data.blend's sources).

The model (its shape and sequence length) and its tokenizer come from the checkpoint (the copy it
keeps of a Hugging Face tokenizer): data made with another tokenizer is refused in one line saying to
tokenize it with the checkpoint's. With data.valid_path only that file is opened. The overrides change data.*
(or pick another option with `data=NAME`), train.eval_steps, parallel.micro_batch_size and
parallel.global_batch_size. It runs in one process on the GPU when there is one, else the CPU,
holding the whole model: a model larger than one device is evaluated by a training run's eval
(train.eval_interval) instead.

Bad input ends with one line `megaframe-eval: error: ...` and exit code 2; token ids outside the
model's vocabulary with exit code 4 (docs/failures.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from megaframe.common.ctrl_c import interrupted_in_one_line
from megaframe.common.one_line_args import OneLineParser
from megaframe.common.result_output import printed_to_stdout, require_stdout

PROG = "megaframe-eval"
ALLOWED = ("data.", "data=", "train.eval_steps=", "parallel.micro_batch_size=", "parallel.global_batch_size=")


def _fail(message: str, code: int = 2) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _eval_config(checkpoint: Path, overrides: Sequence[str], tokenizer: Optional[str] = None):
    """(typed config, the run config file it came from or None): the run's own config with the
    overrides applied; without one, only data the overrides name (never a default dataset).
    tokenizer: the checkpoint's (_model_tokenizer), in place of the config's data.tokenizer."""
    from megaframe.config.compose import compose
    from megaframe.config.validate import ConfigError
    from megaframe.run_config import IncompleteRunConfig, load_run_config, run_config_file

    config_file = run_config_file(checkpoint)
    names_data = any(o.startswith(("data.path=", "data.blend=", "data=")) for o in overrides)
    if config_file is not None and os.path.lexists(config_file):  # a FIFO or folder: named, not "missing"
        try:
            return _checked(_with_tokenizer(load_run_config(config_file, overrides), tokenizer), config_file,
                            overrides), config_file
        except IncompleteRunConfig:
            if not names_data:
                raise
            config_file = None  # a cut file, as a missing one: the data the user named, nothing of the file
    if names_data:
        # the user named the data: theirs, not the run's
        return _checked(_with_tokenizer(compose(list(overrides))[0], tokenizer), None), None
    where = config_file or f"{checkpoint} (a checkpoint outside a run directory)"
    raise ConfigError(f"{where}: the run's config is missing, so the data it trained on is unknown; name the data "
                      f"to score with data.path=PREFIX (and data.valid_path=PREFIX), data.blend=... or data=demo")


def _with_tokenizer(cfg, tokenizer: Optional[str]):
    if tokenizer is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))


def _checked(cfg, config_file: Optional[Path], overrides: Sequence[str] = ()):
    """cfg, after the rules megaframe-train runs on data before launch: an empty value
    (`data.blend=[]`, `data.valid_path=`) falls back to other data (the demo corpus, a slice of the
    training set), which would be scored in silence; a missing file is named with whose it is."""
    from megaframe.config.empty_values import empty_value_problem
    from megaframe.config.validate import ConfigError, check_data

    if problem := empty_value_problem(cfg):
        raise ConfigError(problem)
    # with no validation set evaluate() says what to override; check_data's line would name
    # train.eval_interval, which this command does not take
    data = cfg.data
    if data.valid_path is not None and not data.blend:  # scored alone (build_eval_data): data.path may be gone
        data = dataclasses.replace(data, path=None)
    no_eval_interval = dataclasses.replace(cfg.train, eval_interval=0)
    if problem := check_data(dataclasses.replace(cfg, data=data, train=no_eval_interval)):
        # the run's config is blamed only for a key the command line did not set (a typo in data.path=... is the user's)
        key = match[0] if (match := re.match(r"data\.\w+", problem)) else ""
        ours = config_file is not None and not any(o.startswith((f"{key}=", "data=")) for o in overrides)
        raise ConfigError(f"the run's data ({config_file}): {problem}" if ours else problem)
    return cfg


def describe_data(data) -> str:
    """The validation set a DataConfig names, in words."""
    if data.blend:
        return f"data.valid_blend={data.valid_blend}" if data.valid_blend else \
            f"held-out {data.valid_fraction:g} of data.blend's sources"
    if data.valid_path:
        return f"data.valid_path={data.valid_path}"
    return f"held-out {data.valid_fraction:g} of " + (f"data.path={data.path}" if data.path else "the demo corpus")


def evaluate(checkpoint: Path, overrides: Sequence[str]) -> dict:
    """{"checkpoint", "config", "data", "samples", "tokens_per_sample", "loss", "perplexity",
    "bits_per_byte" or "bits_per_token"}; raises ValueError (ConfigError, ConvertError, DataError)
    with one line on bad input, BadData (exit 4) for token ids outside the model's vocabulary."""
    import torch

    from megaframe.config.validate import ConfigError
    from megaframe.convert.files import resolve_checkpoint
    from megaframe.data import DataError, eval_batches
    from megaframe.data.dataset import eval_wrap_problem
    from megaframe.load import load_model
    from megaframe.run_config import named_checkpoint
    from megaframe.data.formats import TokenizerMismatch
    from megaframe.tracking.loss_report import bits
    from megaframe.training.data_setup import build_eval_data

    for override in overrides:
        if not override.startswith(ALLOWED):
            raise ConfigError(f"{override.split('=', 1)[0]}: the model comes from the checkpoint; {PROG} takes "
                              f"data.*, train.eval_steps, parallel.micro_batch_size and parallel.global_batch_size")
    path = resolve_checkpoint(checkpoint)
    named = named_checkpoint(checkpoint, path)
    model_tokenizer = _model_tokenizer(path, overrides, named)  # the data is scored as the model reads it
    cfg, config_file = _eval_config(named, overrides, model_tokenizer)
    batch, micro = cfg.parallel.global_batch_size, cfg.parallel.micro_batch_size
    if micro < 1 or batch < 1:  # -16 "must be a multiple of" -8, which it is (review)
        raise ConfigError(f"parallel.micro_batch_size={micro} and parallel.global_batch_size={batch} must be >= 1")
    if batch % micro:
        raise ConfigError(f"parallel.global_batch_size={batch} must be a multiple of parallel.micro_batch_size={micro}")
    if cfg.train.eval_steps < 1:
        raise ConfigError(f"train.eval_steps={cfg.train.eval_steps} must be >= 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(path, device)
    where = describe_data(cfg.data)
    try:
        data = build_eval_data(cfg.data, model.dims.seq_length)
    except TokenizerMismatch as err:
        if model_tokenizer is None:  # a checkpoint without a tokenizer record: the run config's names it
            raise DataError(str(err)) from None
        raise DataError(f"{err.prefix}: its tokens were made by {err.recorded} ({err.prefix}.json), but the "
                        f"checkpoint's model reads {model_tokenizer}'s: tokenize its text with megaframe-preprocess "
                        f"--tokenizer {model_tokenizer}") from None
    except (DataError, OSError) as err:  # the run's files moved or deleted: say whose they were
        named = any(o.startswith(("data.path=", "data.valid_path=", "data.blend=", "data.valid_blend=", "data="))
                    for o in overrides)  # data the command line named is not the run's
        origin = f"the run's data ({config_file})" if config_file and not named else "the data"
        raise DataError(f"{origin}: {err}") from None
    if data.valid is None:
        raise DataError(f"{where}: data.valid_fraction=0 leaves no validation set to evaluate; set "
                        f"data.valid_fraction > 0 or data.valid_path=PREFIX")
    if data.vocab_size > model.dims.vocab_size:
        raise DataError(f"the dataset's vocabulary ({data.vocab_size}) is larger than the checkpoint's model's "
                        f"({model.dims.vocab_size}): it was tokenized for another model; tokenize its text with "
                        f"megaframe-preprocess --tokenizer {model_tokenizer or cfg.data.tokenizer}")
    if problem := eval_wrap_problem(cfg.train.eval_steps, batch, data.valid.samples_before_a_repeat()):
        # asked on this command line, it is refused (train.eval_steps=100000000 ran on for good);
        # the run's own setting is evaluated as the run evaluated it, with the run's warning
        if any(o.startswith(("train.eval_steps=", "parallel.global_batch_size=")) for o in overrides):
            raise DataError(problem)
        print(f"{PROG}: warning: {problem}", file=sys.stderr, flush=True)
    batches = eval_batches(data.valid, cfg.train.eval_steps * (batch // micro), micro, 0, 1)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for inputs, targets in batches:  # each micro-batch's mean, as the trainer's evaluate() takes them
            _check_ids(inputs, targets, model.dims.vocab_size, where)  # on the host, before the device sees them
            total += model(inputs.to(device), targets.to(device)).double()
    loss = (total / len(batches)).item()
    unit, value = bits(loss, cfg.data.tokenizer)
    return {"checkpoint": str(path), "config": str(config_file) if config_file else None, "data": where,
            "samples": cfg.train.eval_steps * batch, "tokens_per_sample": model.dims.seq_length, "loss": loss,
            "perplexity": perplexity(loss), unit: value}


def perplexity(loss: float) -> float:
    """exp(loss): inf past exp's range; a NaN loss (a diverged checkpoint) is a NaN perplexity, not
    the inf it was printed as (review)."""
    return float("inf") if loss >= 700 else math.exp(loss)


def _model_tokenizer(path: Path, overrides: Sequence[str], named: Path) -> Optional[str]:
    """The tokenizer the checkpoint's model was trained with, as megaframe-sample and to-hf choose it
    (tokenizer_export.tokenizer_source: a data.tokenizer override, the checkpoint's copy or the run's
    recorded directory, each verified against the checkpoint's record); None when the checkpoint
    records none. An override naming another tokenizer is refused: the model's ids would be read as
    other text. `named`: the checkpoint as the user named it (its run dir)."""
    from megaframe.checkpoint import tokenizer_record as records
    from megaframe.checkpoint import universal
    from megaframe.config.validate import ConfigError
    from megaframe.convert.hf import ConvertError
    from megaframe.convert.tokenizer_export import tokenizer_source
    from megaframe.run_config import run_dir_of

    try:
        state = universal.read_state(path)
    except universal.CheckpointError:  # load_model names what is wrong with the checkpoint
        return None
    asked = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("data.tokenizer=")), None)
    try:
        _, source, _ = tokenizer_source(path, state, asked, run_dir_of(named), flag="data.tokenizer=")
    except ConvertError as err:
        saved = state.get(records.RECORD_KEY)
        if asked is None or not records.is_record(saved):
            raise ConfigError(str(err)) from None
        raise ConfigError(f"data.tokenizer={asked}: the checkpoint's model was trained with "
                          f"{records.describe(saved)}, and reads no other tokenizer's ids; leave data.tokenizer out "
                          f"(the checkpoint's is used)") from None
    return None if source is None else str(source)


def _check_ids(inputs, targets, vocab_size: int, where: str) -> None:
    """BadData (exit 4) for an id below 0 or at or above the model's vocabulary: the embedding would
    fail deep inside with an IndexError (or, padded, score a token no logit stands for)."""
    from megaframe.common.failures import BadData

    for ids in (inputs, targets):
        smallest, largest = int(ids.min()), int(ids.max())
        if smallest < 0 or largest >= vocab_size:
            bad = smallest if smallest < 0 else largest
            raise BadData(f"{where}: token id {bad} is outside the model's vocabulary of {vocab_size}; the data was "
                          f"tokenized with another tokenizer or is corrupt: rebuild it with megaframe-preprocess")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("checkpoint", type=Path, help="a layout-free checkpoint, or a run's checkpoints/ directory")
    parser.add_argument("overrides", nargs="*", help="data.* (or data=NAME), train.eval_steps, "
                                                      "parallel.micro_batch_size, parallel.global_batch_size")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return parser


def human_line(result: dict) -> str:
    """The result in one line: what was scored, on what, and the figures."""
    unit = "bits_per_byte" if "bits_per_byte" in result else "bits_per_token"
    return (f"{PROG}: {result['checkpoint']} on {result['data']}: loss {result['loss']:.4f}, perplexity "
            f"{result['perplexity']:.2f}, {result[unit]:.4f} {unit.replace('_', ' ')} over {result['samples']} "
            f"samples of {result['tokens_per_sample']} tokens")


def main(argv: Optional[Sequence[str]] = None) -> None:
    with interrupted_in_one_line(PROG):
        _main(argv)


def _main(argv: Optional[Sequence[str]]) -> None:
    from megaframe.common.failures import BadData
    from megaframe.tracking.metrics import strict_json

    args = build_parser().parse_args(argv)
    require_stdout(PROG)
    try:
        result = evaluate(args.checkpoint, args.overrides)
    except BadData as err:
        _fail(str(err), int(err.exit_code))
    except ValueError as err:  # ConfigError, ConvertError, DataError: one line each
        _fail(str(err))
    with printed_to_stdout(PROG):  # a closed pipe, a full disk behind a redirect: no traceback
        if args.json:  # strict JSON: a non-finite loss is null, not NaN/Infinity
            print(json.dumps(strict_json(result), allow_nan=False))
        else:
            print(human_line(result))


if __name__ == "__main__":
    main()
