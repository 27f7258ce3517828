"""`megaframe-convert` (= `python -m megaframe.convert`):

  to-hf CKPT OUT      a layout-free megaframe checkpoint -> a transformers model directory, with the
                      tokenizer the weights were trained with (convert/tokenizer_export.py)
  from-hf HF_DIR OUT  a local Llama / GPT-2 / Mixtral / Qwen3-MoE transformers directory -> a
                      model-only megaframe checkpoint
Both directions go one output tensor at a time (safetensors read on demand, written streaming; a
stacked expert tensor is read one expert at a time): the model is never whole in memory. HF .bin
weights are pickles and load whole.

Bad input ends with one line `megaframe-convert: error: ...` and exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

from megaframe.config.schema import ModelConfig, MoEConfig
from megaframe.convert import files
from megaframe.checkpoint.tokenizer_record import RECORD_KEY
from megaframe.checkpoint.universal import read_state
from megaframe.common.failures import output_failure
from megaframe.common.one_line_args import OneLineParser
from megaframe.common.tokenizer_files import has_tokenizer
from megaframe.convert import tokenizer_export as tokens
from megaframe.data.preprocess_stop import Stopped, stop_on_signals
from megaframe.convert.hf import (ConvertError, check_tied_copy, config_from_hf, plan_shapes, state_from_hf_plan,
                                  to_hf_plan)
from megaframe.model.dims import model_config_from_record

PROG = "megaframe-convert"


def model_config(state: dict, where: Path) -> ModelConfig:
    """The ModelConfig recorded in a checkpoint's state.json."""
    try:
        return model_config_from_record(state.get("model"))
    except ValueError as err:
        raise ConvertError(f"{where}: {err}") from None


def model_overrides(cfg: ModelConfig) -> list[str]:
    """`model.KEY=VALUE` Hydra overrides that recreate `cfg` on the megaframe-train command line."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig) if f.name != "moe"}
    values.update({f"moe.{f.name}": getattr(cfg.moe, f.name) for f in dataclasses.fields(MoEConfig)})
    # JSON spells null/true/false and numbers as Hydra's override grammar reads them
    return [f"model.{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in values.items()]


def export_hf(ckpt: Path, out: Path, force: bool = False, tokenizer: Union[str, Path, None] = None,
              dtype: str = "float32", max_shard_size: Union[str, int] = "5GB") -> str:
    """Write the transformers directory for checkpoint `ckpt` to `out`, one tensor at a time (the
    model is never whole in memory), with the tokenizer the weights were trained with (`tokenizer`:
    a directory holding it, checked against the checkpoint's record); return a summary line.
    dtype: the weights' (float32, exact; bfloat16 or float16 halve them); max_shard_size: the largest
    weight file (save_pretrained's sharding)."""
    if dtype not in files.HF_DTYPES:
        raise ConvertError(f"--dtype {dtype}: use one of {', '.join(files.HF_DTYPES)}")
    shard_bytes = files.parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    from megaframe.run_config import named_checkpoint, run_dir_of

    named, ckpt = ckpt, files.resolve_checkpoint(ckpt)
    files.refuse_existing(out, force, source=ckpt, pruned_source=True)  # after `latest` is resolved: the checkpoint
    state, reader = files.open_layout_free(ckpt)
    cfg = model_config(state, ckpt)
    if tokenizer is not None and tokens.checkpoint_record(ckpt, state) is None:  # nothing to check it against
        raise ConvertError(f"--tokenizer {tokenizer}: {ckpt} was trained with no recorded tokenizer; drop --tokenizer")
    # before any weights are read: a tokenizer that cannot ship refuses the export (the rule megaframe-sample uses)
    record, chosen, note = tokens.tokenizer_source(ckpt, state, tokenizer, run_dir_of(named_checkpoint(named, ckpt)))
    source = chosen if record is not None and record["kind"] == "hf" else None
    if record is None:
        note = "no tokenizer (the checkpoint names none)"
    with reader:
        weights = files.model_tensors(reader)
        padded_rows = weights.shapes["embed.tok.weight"][0]
        hf_config, plan = to_hf_plan(cfg, weights.shapes)
        shapes = plan_shapes(plan, weights.shapes)
        tmp = files.staging_dir(out, force)
        try:
            if source is not None:
                files.copy_tokenizer(source, tmp)
                _set_special_tokens(hf_config, tmp, named=source)  # the copy as users load it; errors name the source
            elif record is not None:
                tokens.write_byte_tokenizer(tmp, cfg.seq_length)
            if record is not None:
                tokens.set_special_ids(hf_config, record.get("eod_id"), record.get("bos_id"))
            hf_config.save_pretrained(str(tmp))
            files.add_legacy_config_keys(tmp / "config.json", dtype=dtype)
            tokens.write_generation_config(tmp, hf_config, cfg.seq_length)
            written = files.write_hf_weights(tmp, files.LazyTensors(shapes, lambda name: plan[name](weights)),
                                             files.HF_DTYPES[dtype], shard_bytes)
            files.publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    params = sum(math.prod(shape) for shape in shapes.values())
    dropped = padded_rows - hf_config.vocab_size
    capacity = cfg.moe.capacity_factor if cfg.moe.num_experts else None
    return (f"wrote {out}: {hf_config.architectures[0]} from {ckpt} (step {state.get('step', '?')}), "
            f"{params / 1e6:.2f}M parameters, vocab {hf_config.vocab_size}"
            + (f" ({dropped} padded rows dropped)" if dropped else "")
            + (f", routing dropless (the run capped experts at capacity_factor={capacity})" if capacity else "")
            + f", {dtype}" + (f" in {written} files" if written > 1 else "") + f", {note}")


def _set_special_tokens(hf_config, tokenizer_dir: Path, named: Optional[Path] = None) -> None:
    """bos/eos/pad ids of the copied tokenizer, so generate() stops where the model was taught to.
    named: the directory an error names (the copy's source: the copy is in a staging folder)."""
    from transformers import AutoTokenizer

    try:  # never the directory's own Python (an auto_map): transformers would ask on the terminal to run it
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, trust_remote_code=False)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError... depending on what is wrong
        named = named or tokenizer_dir
        if tokens.names_own_code(tokenizer_dir):  # transformers' text names the staging folder, gone by then
            raise ConvertError(f"{named}: the checkpoint's tokenizer does not load: its tokenizer_config.json names "
                               f"its own Python (auto_map), which megaframe never runs, so it cannot ship with the "
                               f"export") from None
        reason = " ".join(str(error).replace(str(tokenizer_dir), str(named)).split())[:300]
        raise ConvertError(f"{named}: the checkpoint's tokenizer does not load ({type(error).__name__}: {reason}); "
                           f"install what it needs to load here (sentencepiece, tiktoken) and export again") from None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None and value < hf_config.vocab_size:
            setattr(hf_config, key, value)


def import_hf(hf_dir: Path, out: Path, force: bool = False) -> tuple[ModelConfig, str]:
    """Write a model-only (step 0) layout-free checkpoint of HF model `hf_dir` to `out`."""
    hf_dir = Path(hf_dir)
    files.refuse_existing(out, force, source=hf_dir)  # before reading gigabytes of weights
    hf_config = files.read_hf_config(hf_dir)
    try:
        cfg = config_from_hf(hf_config)  # refuse an unsupported model before reading gigabytes of weights
    except ConvertError:
        raise
    except (KeyError, TypeError, ValueError, ArithmeticError, AttributeError) as err:  # a key missing or mistyped
        reason = f"no {err.args[0]!r} key" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise ConvertError(f"{hf_dir / 'config.json'}: not a complete {hf_config.get('model_type')} config "
                           f"({reason}); pass a directory written by save_pretrained()") from None
    weights = files.read_hf_weights(hf_dir)
    plan, shapes = state_from_hf_plan(cfg, {name: files.shape_of(weights, name) for name in weights})
    check_tied_copy(cfg, weights)
    state = files.LazyTensors(shapes, lambda name: plan[name](weights))
    record = {"step": 0, "consumed_samples": 0, "model": dataclasses.asdict(cfg),
              "source": {"hf_dir": str(hf_dir.resolve()), "model_type": hf_config["model_type"]}}
    tokenizer, left_behind = (hf_dir if has_tokenizer(hf_dir) else None), ""
    if tokenizer is not None:  # what a resume with data.tokenizer=OUT/tokenizer is checked against
        tokenizer_record, left_behind = tokens.import_record(hf_dir)
        if tokenizer_record is not None:  # None: not copied, every later use would refuse it
            record[RECORD_KEY] = tokenizer_record
        if tokenizer_record is None or tokenizer_record["kind"] == "byte":  # data.tokenizer=byte needs no copy
            tokenizer = None
    files.write_layout_free(out, state, record, tokenizer_src=tokenizer, force=force)
    params = sum(math.prod(shape) for shape in state.shapes.values())
    experts = (f" ({hf_config['model_type']}: {cfg.moe.num_experts} experts, top-{cfg.moe.top_k})"
               if cfg.moe.num_experts else "")
    summary = (f"wrote {out}: {cfg.arch} checkpoint{experts} from {hf_dir}, {params / 1e6:.2f}M parameters, "
               f"vocab {cfg.vocab_size}" + (", tokenizer copied to tokenizer/" if tokenizer else
                                            f", tokenizer not copied: {left_behind}" if left_behind else
                                            ", megaframe's byte-level tokenizer (data.tokenizer=byte)"
                                            if RECORD_KEY in record else ", no tokenizer found"))
    return cfg, summary


def build_parser() -> argparse.ArgumentParser:
    """The command line: two subcommands."""
    parser = OneLineParser(prog=PROG, description="Convert between megaframe checkpoints and Hugging Face models.")
    sub = parser.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-hf", help="megaframe checkpoint -> transformers model directory")
    to.add_argument("ckpt", type=Path, help="layout-free checkpoint dir, or a run's checkpoints/ dir (uses `latest`)")
    to.add_argument("out", type=Path, help="output directory (AutoModelForCausalLM.from_pretrained loads it)")
    to.add_argument("--dtype", default="float32", choices=list(files.HF_DTYPES),
                    help="the exported weights' dtype (float32: exact; bfloat16 halves them, as models are served)")
    to.add_argument("--max-shard-size", default="5GB",
                    help="the largest weight file, e.g. 5GB (save_pretrained's sharding; the Hub takes none over 50GB)")
    to.add_argument("--tokenizer", default=None,  # a str: an empty one is refused, Path("") would be "."
                    help="a directory holding the HF tokenizer the run trained with, when neither the checkpoint's "
                         "copy nor the run's data.tokenizer does (its files must hash to the checkpoint's record)")
    frm = sub.add_parser("from-hf", help="local Llama / GPT-2 / Mixtral / Qwen3-MoE transformers directory -> "
                                         "megaframe checkpoint")
    frm.add_argument("hf_dir", type=Path, help="directory with config.json and safetensors / .bin weights")
    frm.add_argument("out", type=Path, help="output checkpoint directory (train.resume=OUT)")
    for p in (to, frm):
        p.add_argument("--force", action="store_true", help="replace OUT if it exists (only once the new one is complete)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of `megaframe-convert`."""
    args = build_parser().parse_args(argv)
    before = _identity(args.out)
    try:
        with stop_on_signals():  # SIGTERM (a scheduler's time limit) cleans up as Ctrl-C does
            _run(args)
    except Stopped as stop:
        # during the publish's renames, which it waited for, or after them (the summary still to print):
        # OUT is a directory other than the one there before, and complete (it came by one rename)
        if stop.written or _replaced(args.out, before):
            if args.command == "from-hf" and not getattr(args, "reported", False):  # the command the user came for
                print(_continue_command(args, model_config(read_state(args.out), args.out)), flush=True)
            print(f"{PROG}: stopped by {stop} after {args.out} was written and in place: it is complete",
                  file=sys.stderr, flush=True)
            return
        print(f"{PROG}: stopped by {stop}: nothing was published (an earlier output is untouched)", file=sys.stderr,
              flush=True)
        sys.exit(stop.exit_code)
    except ConvertError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except OSError as err:  # the storage mid-way (ENOSPC, EIO): what and where, in one line
        if _replaced(args.out, before):  # the summary's own write (stdout a closed pipe): OUT is in place
            return
        print(f"{PROG}: error: {output_failure(err, args.out)}; nothing was published (an earlier output is "
              "untouched)", file=sys.stderr, flush=True)
        sys.exit(1)


def _run(args: argparse.Namespace) -> None:
    """The subcommand, its summary printed."""
    if args.command == "to-hf":
        print(export_hf(args.ckpt, args.out, args.force, args.tokenizer, args.dtype, args.max_shard_size), flush=True)
    else:
        cfg, summary = import_hf(args.hf_dir, args.out, args.force)
        print(summary, flush=True)
        print(_continue_command(args, cfg), flush=True)
    args.reported = True  # a stop from here on: the closing lines are out (main does not print them twice)


def _continue_command(args: argparse.Namespace, cfg: ModelConfig) -> str:
    """from-hf's closing lines: the megaframe-train command that continues from the import."""
    kind = (read_state(args.out).get(RECORD_KEY) or {}).get("kind")
    tokenizer = {"hf": f" data.tokenizer={args.out / files.TOKENIZER_DIR}", "byte": " data.tokenizer=byte"
                 }.get(kind, "")
    return ("continue pre-training with:\n  megaframe-train " + " ".join(model_overrides(cfg))
            + f"{tokenizer} train.resume={args.out}")


def _replaced(out: Path, before: Optional[tuple[int, int]]) -> bool:
    """Whether a new output is in place at `out`: another directory than the one there before (it came
    by one rename, complete)."""
    return _identity(out) not in (None, before)


def _identity(path: Path) -> Optional[tuple[int, int]]:
    """(device, inode) of what is at `path` now, None when nothing is (a link is not followed)."""
    try:
        status = os.lstat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino
