"""`megaframe-preprocess` (= `python -m megaframe.data.preprocess_cli`): tokenize .txt / .jsonl /
.parquet text or a local `datasets` directory into an indexed dataset (PREFIX.bin, PREFIX.idx:
Megatron-LM's layout by default; PREFIX.json: megaframe's sidecar). The work is data/preprocess.py."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from megaframe.common.ctrl_c import shutdown_not_stopped
from megaframe.common.one_line_args import OneLineParser
from megaframe.common.failures import output_failure
from megaframe.data import DataError, build_tokenizer, preprocess
from megaframe.data.indexed import LAYOUTS
from megaframe.data.preprocess import usable_workers
from megaframe.data.preprocess_stop import Stopped, stop_on_signals

PROG = "megaframe-preprocess"


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of the tool."""
    parser = OneLineParser(
        prog=PROG,
        description="Tokenize text files into PREFIX.bin/.idx/.json for megaframe training (data.path=PREFIX).",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files or directories (walked recursively, sorted, hidden ones left out); .txt = one document per file, "
        ".jsonl = one per line, .parquet = one per row; a datasets save_to_disk directory = one per row",
    )
    parser.add_argument(
        "--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin, PREFIX.idx, PREFIX.json"
    )
    parser.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|DIR",
        help="'byte' (UTF-8 bytes, vocab 257) or a local Hugging Face tokenizer directory (default: byte)",
    )
    parser.add_argument(
        "--json-key", "--text-key", dest="json_key", default="text", metavar="KEY",
        help="field of each .jsonl line, column of each .parquet / datasets row, holding the text (default: text)"
    )
    parser.add_argument("--split", default=None, metavar="NAME",
                        help="split of a datasets DatasetDict directory (default: train)")
    parser.add_argument("--format", dest="layout", choices=LAYOUTS, default=LAYOUTS[0],
                        help="megatron (default): Megatron-LM's .bin/.idx, which Megatron, GPT-NeoX and "
                        "Megatron-DeepSpeed read as is, plus megaframe's .json sidecar; megaframe: the earlier "
                        "MFTOKIDX layout")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="tokenizer processes (default: 1; at most the cores available); output is identical "
                        "for any N")
    parser.add_argument("--valid-fraction", type=float, default=0.0, metavar="F",
                        help="hold out the end of the input as a validation set (as data.valid_fraction splits: "
                        "the last F of the documents, or of a single document's tokens) and write it to "
                        "PREFIX_val; train with data.path=PREFIX data.valid_path=PREFIX_val")
    parser.add_argument("--valid-output-prefix", default=None, metavar="PREFIX",
                        help="where --valid-fraction writes the held-out part (default: OUTPUT_PREFIX_val)")
    parser.add_argument(
        "--no-append-eod",
        dest="append_eod",
        action="store_false",
        help="do not append the end-of-document token after each document",
    )
    return parser


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first flag given an empty or blank value (`--input "$DIR"` with DIR unset), or an output
    prefix that names a folder, as one line, or None: an empty --input walked the current directory,
    an empty --output-prefix wrote hidden .bin/.idx/.json files into it, an empty --split read the
    train split."""
    given = [("--input", value, "give a file or directory") for value in args.input] + [
        ("--output-prefix", args.output_prefix, "give the prefix of the files to write, e.g. data/corpus"),
        ("--tokenizer", args.tokenizer, "give byte or a tokenizer directory, or leave the flag out (byte)"),
        ("--json-key", args.json_key, "give the field holding the text, or leave the flag out (text)"),
        ("--split", args.split, "give a split's name, or leave the flag out (train)")]
    for flag, value, fix in given:
        if value is not None and not value.strip():
            return f"{flag} is empty (an unset shell variable?); {fix}"
    for flag, value in (("--output-prefix", args.output_prefix), ("--valid-output-prefix", args.valid_output_prefix)):
        if value is not None and (value.endswith(("/", os.sep)) or Path(value).name in ("", ".", "..")):
            # newdata/ wrote newdata.bin beside the folder, and data.path=newdata/ then found nothing
            folder = value.rstrip("/" + os.sep) or value
            return (f"{flag} {value} names a folder; a prefix names the files to write: e.g. "
                    f"{flag} {Path(folder) / 'corpus'} writes corpus.bin, corpus.idx and corpus.json in {folder}")
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the process exit code (2 on bad input, 1 on a full disk or quota, 128 + N
    when signal N stopped it before the datasets were in place, 0 when after)."""
    args = build_parser().parse_args(argv)
    if problem := argument_problem(args):
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    if args.valid_output_prefix and not args.valid_fraction:
        print(f"{PROG}: error: --valid-output-prefix needs --valid-fraction F (the part to hold out)", file=sys.stderr)
        return 2
    workers, capped = usable_workers(args.workers) if args.workers >= 1 else (args.workers, None)
    if capped:
        print(f"{PROG}: {capped}", file=sys.stderr)
    summary = None
    try:
        with stop_on_signals():
            tokenizer = build_tokenizer(args.tokenizer, named="--tokenizer ")
            summary = preprocess(args.input, args.output_prefix, tokenizer, args.json_key, args.append_eod,
                                 layout=args.layout, workers=workers, split=args.split,
                                 valid_fraction=args.valid_fraction, valid_prefix=args.valid_output_prefix)
            _report(summary)  # a signal meanwhile: reported in full below, exit 0 (the datasets are in place)
    except DataError as error:
        message = " ".join(str(error).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    except OSError as error:  # the storage mid-way: a full disk or quota is no fault of the input (exit 1)
        if summary is not None:  # the report's own write (stdout a closed pipe): the datasets are in place
            return 0
        more = [args.valid_output_prefix or f"{args.output_prefix}_val"] if args.valid_fraction else []
        print(f"{PROG}: error: {output_failure(error, args.output_prefix, *more)}; nothing was published (a "
              f"dataset already at {args.output_prefix} is untouched)", file=sys.stderr)
        return 1 if error.errno in (errno.ENOSPC, errno.EDQUOT) else 2
    except Stopped as stop:
        if summary is None and not stop.written:
            print(f"{PROG}: stopped by {stop}: nothing written, temporary files removed; a dataset already at "
                  f"{args.output_prefix} is untouched", file=sys.stderr)
            return stop.exit_code
        return _stopped_after_writing(stop, summary)
    return 0


def _report(summary: dict) -> None:
    """What was written, and with --valid-fraction the keys that train on it."""
    print(
        f"{PROG}: wrote {summary['output_prefix']}.{{bin,idx,json}}: {summary['num_documents']} documents, "
        f"{summary['num_tokens']} tokens from {summary['num_files']} inputs in {summary['seconds']:.2f} s "
        f"({summary['tokens_per_second']:,.0f} tokens/s, {summary['workers']} workers, {summary['layout']} layout)"
    )
    if summary.get("orphans_removed"):
        print(f"{PROG}: removed {summary['orphans_removed']} temporary files that a killed {PROG} left beside "
              f"{summary['output_prefix']}", file=sys.stderr)
    if valid := summary.get("valid"):
        print(f"{PROG}: wrote {valid['output_prefix']}.{{bin,idx,json}}: {valid['num_documents']} documents, "
              f"{valid['num_tokens']} tokens (held out: --valid-fraction {valid['valid_fraction']})")
        print(f"{PROG}: train on them with data.path={summary['output_prefix']} data.valid_path={valid['output_prefix']}")


def _stopped_after_writing(stop: Stopped, summary: dict | None) -> int:
    """A signal that came once the datasets were in place: they are complete, so the tool reports them
    and exits 0 (the work is done; 128+N would tell a script to discard or redo a good dataset)."""
    if summary is not None:
        _report(summary)
    else:
        for prefix in stop.written:
            print(f"{PROG}: wrote {prefix}.{{bin,idx,json}}")
        if len(stop.written) == 2:
            print(f"{PROG}: train on them with data.path={stop.written[0]} data.valid_path={stop.written[1]}")
    print(f"{PROG}: stopped by {stop} after the datasets were written and in place: they are complete",
          file=sys.stderr)
    return 0


def console_main() -> None:
    """`python -m megaframe.data.preprocess_cli`: main()'s return value as the exit code, the shutdown
    after it not stopped by a late Ctrl-C (common/ctrl_c.py; the console script's is preprocess_console.py)."""
    try:
        code = main()
    finally:
        shutdown_not_stopped()
    sys.exit(code)


if __name__ == "__main__":
    console_main()
