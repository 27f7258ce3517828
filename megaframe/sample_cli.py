"""`megaframe-sample CKPT`: text a checkpoint's model writes after a prompt (nanoGPT's sample.py).

CKPT is a layout-free checkpoint directory or a run's checkpoints/ directory (its `latest`), written
in any layout by either engine. The whole model loads in one process (megaframe.load_model) on
--device, and generates with a key/value cache (megaframe/model/generate.py): the context is the
model's seq_length (a longer prompt is cropped to its last seq_length tokens) and a sample ends at
the end-of-document token or after --max-new-tokens. Text is encoded and decoded with the run's
tokenizer: --tokenizer, else the checkpoint's tokenizer/ copy, else the run's data.tokenizer (`byte`
or a Hugging Face tokenizer directory) recorded in its state.json; whichever it is must hash to the
checkpoint's tokenizer record, as `megaframe-convert to-hf` requires (convert/tokenizer_export.py).

Without a prompt a sample starts a new document (the prompt is the end-of-document token).
Temperature 0 (or --top-k 1) is greedy; otherwise --seed makes the samples reproducible.

Bad input ends with one line `megaframe-sample: error: ...` and exit code 2.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

from megaframe.common.ctrl_c import interrupted_in_one_line
from megaframe.common.one_line_args import OneLineParser
from megaframe.common.result_output import printed_to_stdout, require_stdout

PROG = "megaframe-sample"
PROMPT_FILE_BYTES = 64 << 20  # a prompt file read beyond this is refused (the model reads its context)
PROGRESS_EVERY_S = 10.0  # seconds between progress lines on stderr while a generation goes on
SEPARATOR = "---------------"  # between samples, as nanoGPT's sample.py prints them


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("checkpoint", type=Path, help="a layout-free checkpoint, or a run's checkpoints/ directory")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="the text to continue (default: start a new document)")
    prompt.add_argument("--prompt-file", type=Path, help="a UTF-8 text file holding the prompt")
    prompt.add_argument("--prompt-ids", help="the prompt as comma-separated token ids, e.g. 84,104,101")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample (200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; below 1 more likely tokens (0.8)")
    parser.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens; 0 = all (200)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens whose probability reaches p; 1 = all (1.0)")
    parser.add_argument("--seed", type=int, default=1337, help="seed of the sampling (1337)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples to draw, as one batch (1)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N (cpu)")
    parser.add_argument("--tokenizer", help="byte, or a Hugging Face tokenizer directory: overrides the run's")
    parser.add_argument("--json", action="store_true",
                        help="one JSON line per sample: prompt_ids, new_ids, text (the new text), stopped")
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError (one line) for settings that cannot sample; before anything loads."""
    from megaframe.model.generate import check_sampling

    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise ValueError(f"--{str(err).replace('_', '-')}") from None
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples={args.num_samples} must be >= 1")
    if not -2**63 <= args.seed < 2**64:  # torch.Generator's range: "Overflow when unpacking long long" beyond it
        raise ValueError(f"--seed={args.seed} must be in [-2^63, 2^64)")
    if args.prompt == "":
        raise ValueError("--prompt is empty: give some text, or leave --prompt out to start a new document")


def resolve_device(name: str):
    """torch.device(name), refused in one line when it is not one or is not on this machine."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device={name}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(f"--device={name}: this machine has {count} CUDA device(s); use "
                             + ("cpu" if count == 0 else f"cuda:0..cuda:{count - 1}"))
    elif device.type != "cpu":
        raise ValueError(f"--device={name}: {PROG} runs on cpu or cuda")
    return device


def run_tokenizer(checkpoint: Path, state: dict, override: Optional[str], named: Optional[Path] = None):
    """The tokenizer the run trained with, chosen and verified against the checkpoint's tokenizer
    record as `megaframe-convert to-hf` does (tokenizer_export.tokenizer_source): --tokenizer, the
    checkpoint's tokenizer/ copy, or the run's recorded directory (a relative one read from where
    the run trained, not from here). `named`: the checkpoint as the user named it (its run dir).
    DataError or ConvertError (one line) for a missing, empty or other tokenizer."""
    from megaframe.convert.tokenizer_export import tokenizer_source
    from megaframe.data import DataError, build_tokenizer
    from megaframe.run_config import run_dir_of

    _, source, _ = tokenizer_source(checkpoint, state, override, run_dir_of(named or checkpoint))
    if source is None:
        raise DataError(f"{checkpoint}: the checkpoint records no tokenizer; pass --tokenizer byte or "
                        "--tokenizer DIR (the Hugging Face tokenizer its model was trained with)")
    return build_tokenizer(source)


def prompt_ids(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[int]:
    """The prompt's token ids, each one the model and the tokenizer know; ValueError otherwise."""
    if args.prompt_ids is not None:
        try:
            ids = [int(word) for word in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids={args.prompt_ids}: not comma-separated integers") from None
        what = "--prompt-ids"
    elif args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as file:  # at most a bound: /dev/zero or a corpus was read whole
                raw = file.read(PROMPT_FILE_BYTES + 1)
            if len(raw) > PROMPT_FILE_BYTES:
                raise ValueError(f"--prompt-file={args.prompt_file}: larger than {PROMPT_FILE_BYTES >> 20} MiB; a "
                                 f"prompt is at most the model's context, give its end only")
            text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8").read()  # universal newlines, as read_text
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--prompt-file={args.prompt_file}: cannot read it as UTF-8 text ({err})") from None
        if not text:
            raise ValueError(f"--prompt-file={args.prompt_file} is empty: give a prompt, or leave it out to start "
                             "a new document")
        ids, what = tokenizer.encode(text), f"--prompt-file={args.prompt_file}"
    elif args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (Python keeps them as surrogates)
            raise ValueError("--prompt holds bytes that are not UTF-8 text; write the prompt to a file in UTF-8 "
                             "and pass --prompt-file FILE") from None
        ids, what = tokenizer.encode(args.prompt), "--prompt"
    else:  # a new document: what follows an end of document
        ids, what = [tokenizer.eod_id], f"the end-of-document id of {tokenizer.name}"
    if not ids:
        raise ValueError(f"{what}: the prompt encodes to no tokens; give some text")
    limit = min(vocab_size, tokenizer.vocab_size)
    if bad := [i for i in ids if not 0 <= i < limit]:
        raise ValueError(f"{what}: token id {bad[0]} is outside the vocabulary (0..{limit - 1}) of the model and "
                         f"the tokenizer {tokenizer.name}")
    return ids


def sample(args: argparse.Namespace) -> list[dict]:
    """Generate args.num_samples continuations; one dict per sample: prompt_ids, new_ids (the
    end-of-document token left out), text (the new tokens decoded), stopped (at end of document).
    Raises ValueError (ConvertError, DataError) with one line on bad input."""
    import torch

    from megaframe.checkpoint import universal
    from megaframe.convert.files import resolve_checkpoint
    from megaframe.load import load_model

    check_arguments(args)
    device = resolve_device(args.device)
    path = resolve_checkpoint(args.checkpoint)
    try:
        state = universal.read_state(path)
    except universal.CheckpointError as err:
        raise ValueError(str(err)) from None
    from megaframe.run_config import named_checkpoint

    tokenizer = run_tokenizer(path, state, args.tokenizer, named_checkpoint(args.checkpoint, path))
    model = load_model(path, device)
    ids = prompt_ids(args, tokenizer, model.dims.vocab_size)
    window = model.dims.seq_length
    if len(ids) > window:
        print(f"{PROG}: note: the prompt's {len(ids)} tokens exceed the model's context (model.seq_length="
              f"{window}): it sees the last {window}", file=sys.stderr, flush=True)
    try:
        idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
        out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed, eod_id=tokenizer.eod_id,
                             progress=_Progress(args.max_new_tokens, args.num_samples))
    except (MemoryError, RuntimeError) as err:  # torch: "can't allocate memory", "CUDA out of memory"
        if not isinstance(err, MemoryError) and "alloc" not in str(err) and "out of memory" not in str(err):
            raise
        raise ValueError(f"--num-samples={args.num_samples} samples of {len(ids)} prompt tokens and --max-new-tokens="
                         f"{args.max_new_tokens} new tokens do not fit in {device}'s memory; ask for fewer") from None
    results = []
    for row in out[:, len(ids):].tolist():
        stopped = tokenizer.eod_id in row
        new = row[: row.index(tokenizer.eod_id)] if stopped else row
        results.append({"prompt_ids": ids, "new_ids": new, "text": tokenizer.decode(new), "stopped": stopped,
                        "full_text": tokenizer.decode(ids + new)})
    return results


class _Progress:
    """A line on stderr every PROGRESS_EVERY_S seconds of a generation that is still going, so that a
    long one (or a mistyped --max-new-tokens) is not silent until it ends; stdout keeps the text."""

    def __init__(self, total: int, samples: int):
        import time

        self.total, self.samples, self.clock = total, samples, time.monotonic
        self.next_line = self.clock() + PROGRESS_EVERY_S

    def __call__(self, done: int) -> None:
        if done < self.total and self.clock() >= self.next_line:
            self.next_line = self.clock() + PROGRESS_EVERY_S
            if sys.stderr is None:  # started with 2>&-: print(file=None) would write into the result
                return
            try:
                print(f"{PROG}: {done:,} of {self.total:,} new tokens" + (f" ({self.samples:,} samples)" if
                      self.samples > 1 else ""), file=sys.stderr, flush=True)
            except OSError:  # stderr's reader gone (2>&1 | head): the line is a courtesy, the text goes on
                pass


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    require_stdout(PROG)
    with interrupted_in_one_line(PROG):  # Ctrl-C: 130, as megaframe-train's (docs/failures.md), no traceback
        try:
            results = sample(args)
        except ValueError as err:  # ConvertError, DataError, StateMismatch and the checks above: one line each
            _fail(str(err))
    with printed_to_stdout(PROG):  # `| head`: the reader has what it wanted; a full disk: one line
        for i, result in enumerate(results):
            if args.json:
                print(json.dumps({key: value for key, value in result.items() if key != "full_text"}), flush=True)
                continue
            if i:
                print(SEPARATOR)
            print(result["full_text"], flush=True)


if __name__ == "__main__":
    main()
