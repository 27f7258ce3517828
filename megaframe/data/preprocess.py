"""Turn .txt / .jsonl text files into an indexed token dataset (the logic behind tools/preprocess_data.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from megaframe.data.indexed import DataError, IndexedDatasetWriter, best_dtype
from megaframe.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["INPUT_SUFFIXES", "find_input_files", "iter_documents", "preprocess"]

INPUT_SUFFIXES = (".txt", ".jsonl")


def find_input_files(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand files and directories (walked recursively, sorted) into the list of .txt/.jsonl files to read."""
    files: list[Path] = []
    for raw_input in inputs:
        path = Path(raw_input)
        if path.is_dir():
            candidates = (candidate for candidate in path.rglob("*") if candidate.suffix in INPUT_SUFFIXES)
            found = sorted(
                (candidate for candidate in candidates if candidate.is_file()),
                key=lambda candidate: candidate.relative_to(path).parts,
            )
            if not found:
                raise DataError(f"--input {path}: directory holds no {'/'.join(INPUT_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in INPUT_SUFFIXES:
                raise DataError(
                    f"--input {path}: unknown extension {path.suffix or '(none)'!r}; "
                    f"use {' or '.join(INPUT_SUFFIXES)} (one document per .txt file, one per .jsonl line)"
                )
            files.append(path)
        else:
            raise DataError(f"--input {path}: no such file or directory")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"--input {path}: not UTF-8 text (byte {error.start}); convert it to UTF-8") from None


def _iter_jsonl(path: Path, json_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        try:
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                location = f"--input {path}:{line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{location}: invalid JSON ({error.msg}); each line must be one JSON object"
                    ) from None
                if not isinstance(record, dict) or json_key not in record:
                    raise DataError(
                        f"{location}: no {json_key!r} field; pass --json-key NAME for the field holding the text"
                    )
                if not isinstance(record[json_key], str):
                    value_type = type(record[json_key]).__name__
                    raise DataError(f"{location}: field {json_key!r} is {value_type}, not a string")
                yield record[json_key]
        except UnicodeDecodeError as error:
            raise DataError(f"--input {path}: not UTF-8 text (byte {error.start}); convert it to UTF-8") from None


def iter_documents(path: Path, json_key: str = "text") -> Iterator[str]:
    """Documents of one input file: the whole .txt file, or each non-blank .jsonl line's `json_key` field."""
    if path.suffix == ".txt":
        yield _read_text(path)
    elif path.suffix == ".jsonl":
        yield from _iter_jsonl(path, json_key)
    else:
        raise DataError(f"--input {path}: unknown extension {path.suffix!r}; use {' or '.join(INPUT_SUFFIXES)}")


def preprocess(
    inputs: Sequence[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    tokenizer: Tokenizer | str = "byte",
    json_key: str = "text",
    append_eod: bool = True,
) -> dict[str, Any]:
    """Tokenize every document of `inputs` into OUTPUT_PREFIX.bin/.idx/.json; returns a summary dict.

    Each input document becomes one dataset document (empty ones included, so indices line up
    with the input). On any error the previous dataset at `output_prefix`, if any, is left intact.
    """
    started = time.perf_counter()
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer)
    files = find_input_files(inputs)
    if not files:
        raise DataError("--input: no input files given")
    with IndexedDatasetWriter(output_prefix, dtype=best_dtype(tokenizer.vocab_size)) as writer:
        for path in files:
            for text in iter_documents(path, json_key):
                tokens = tokenizer.encode(text)
                if append_eod:
                    tokens.append(tokenizer.eod_id)
                writer.add_document(tokens)
        if writer.num_documents == 0 or writer.num_tokens == 0:
            raise DataError(
                f"--input {' '.join(str(raw) for raw in inputs)}: produced no tokens "
                f"({writer.num_documents} documents); check the files and --json-key"
            )
        writer.finalize(
            {
                "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size,
                "eod_id": tokenizer.eod_id,
                "append_eod": append_eod,
                "json_key": json_key,
                "source_files": [str(path) for path in files],
            }
        )
        summary = {
            "output_prefix": str(output_prefix),
            "num_files": len(files),
            "num_documents": writer.num_documents,
            "num_tokens": writer.num_tokens,
            "tokenizer": tokenizer.name,
        }
    summary["seconds"] = time.perf_counter() - started
    return summary
