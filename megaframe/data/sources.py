"""The text inputs preprocessing reads: .txt files, .jsonl lines, .parquet rows and local Hugging Face
`datasets` (a save_to_disk directory), each yielding its documents in order.

Columnar inputs are read a record batch at a time (pyarrow), never whole: a corpus shard of tens of
GB goes through in bounded memory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from megaframe.common import json_text
from megaframe.common.safe_files import kind_of
from megaframe.data.indexed import DataError

__all__ = ["FILE_SUFFIXES", "Source", "TextFile", "find_sources", "iter_documents"]

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_ARROW_BATCH_ROWS = 1024
_NEEDS_ARROW = "pip install 'megaframe[data]' (pyarrow and datasets)"


@dataclass(frozen=True)
class Source:
    """One input: a file (kind = its suffix without the dot) or a save_to_disk directory (kind "hf")."""

    path: Path
    kind: str


def is_hf_dataset_dir(path: Path) -> bool:
    """A directory written by datasets' save_to_disk: one Dataset, or a DatasetDict of splits."""
    return (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file()
                                                        and (path / "dataset_info.json").is_file())


def _corpus_files(root: Path) -> Iterator[Path]:
    """The .txt/.jsonl/.parquet files under root (the suffix in any case: D.TXT too), hidden files and
    folders left out (not walked): they are not the corpus, and `--input .` would take the text files
    of .git/ and .venv/. A folder linked in from outside root is walked (shards linked in from elsewhere
    were skipped without a word), each real folder once; a link to a folder inside root is not (that
    folder is walked under its own name), nor one to a folder above root (a loop)."""
    top = os.path.realpath(root)
    walked = {top}
    for folder, subfolders, files in os.walk(root, followlinks=True):
        kept = []
        for name in sorted(subfolders):
            real = os.path.realpath(Path(folder) / name)
            inside, above = _below(real, top), _below(top, real)
            linked_back = os.path.islink(Path(folder) / name) and (inside or above)
            if not name.startswith(".") and real not in walked and not linked_back:
                walked.add(real)
                kept.append(name)
        subfolders[:] = kept
        for name in files:
            candidate = Path(folder) / name
            if not name.startswith(".") and _kind(candidate) and candidate.is_file():
                yield candidate


def _below(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _kind(path: Path) -> Optional[str]:
    """"txt", "jsonl" or "parquet" by the file's suffix, in any case; None for another suffix."""
    suffix = path.suffix.lower()
    return suffix[1:] if suffix in FILE_SUFFIXES else None


def find_sources(inputs: Sequence[str | os.PathLike[str]]) -> list[Source]:
    """Expand files and directories (walked recursively, sorted, hidden files and folders left out)
    into sources; a save_to_disk directory is one source. A file named on its own is taken even if
    hidden."""
    sources: list[Source] = []
    for raw_input in inputs:
        path = Path(raw_input)
        if path.is_dir() and is_hf_dataset_dir(path):
            sources.append(Source(path, "hf"))
        elif path.is_dir():
            found = sorted(_corpus_files(path), key=lambda candidate: candidate.relative_to(path).parts)
            if not found:
                raise DataError(f"--input {path}: directory holds no {'/'.join(FILE_SUFFIXES)} files "
                                f"and is not a datasets save_to_disk directory")
            sources.extend(Source(file, _kind(file)) for file in found)
        elif path.is_file():
            if not _kind(path):
                raise DataError(
                    f"--input {path}: unknown extension {path.suffix or '(none)'!r}; use {', '.join(FILE_SUFFIXES)} "
                    "(one document per .txt file, one per .jsonl line or .parquet row) or a datasets directory")
            sources.append(Source(path, _kind(path)))
        elif path.exists():  # a FIFO, a socket, a device: there, but nothing to read documents from
            raise DataError(f"--input {path}: is {kind_of(path.stat().st_mode)}, not a file or a directory; "
                            f"name the corpus file itself")
        else:
            raise DataError(f"--input {path}: no such file or directory")
    return sources


@dataclass(frozen=True)
class TextFile:
    """A .txt input's one document, read only as it is tokenized (long_text.encode_text_file: in
    pieces, whatever the file's size), so counting documents reads nothing."""

    path: Path


def _check_text(value: object, location: str, key: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{location}: field {key!r} is {type(value).__name__}, not a string")
    if not value.isascii():
        try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer can encode
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise DataError(f"{location}: field {key!r} holds a lone surrogate ({value[error.start]!r} at character "
                            f"{error.start}), which is not text; fix or drop that document") from None
    return value


def _iter_jsonl(path: Path, key: str) -> Iterator[str]:
    """Each non-blank line's `key` field. Read as bytes and decoded a line at a time, so a byte that is
    not UTF-8 is named by its line and its offset in the file (a text reader's error counts from its
    own buffer: "byte 7335" for a byte 1.2 MB in)."""
    offset, line_number = 0, 0
    with open(path, "rb") as raw_lines:
        for raw in raw_lines:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                line = line_number + 1 + raw[:error.start].replace(b"\r\n", b"\n").count(b"\r")  # lone CRs before it
                raise DataError(f"--input {path}:{line}: not UTF-8 text (byte {offset + error.start} of the file); "
                                "convert it to UTF-8") from None
            offset += len(raw)
            # lines end as a text reader ends them (universal newlines): "\n", "\r\n" or a lone "\r"
            for line in text.replace("\r\n", "\n").split("\r"):
                line_number += 1
                if line.strip():
                    yield _jsonl_text(line, f"--input {path}:{line_number}", key)


def _jsonl_text(line: str, location: str, key: str) -> str:
    """The text in one .jsonl line's `key` field."""
    try:
        record = json_text.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{location}: invalid JSON ({error.msg}); each line must be one JSON object") from None
    if not isinstance(record, dict):
        raise DataError(f"{location}: a JSON {type(record).__name__}, not an object; each line must be one "
                        f"JSON object with a {key!r} field")
    if key not in record:
        fields = ", ".join(repr(name)[:40] for name in list(record)[:10]) + (", ..." if len(record) > 10 else "")
        raise DataError(f"{location}: no {key!r} field (it has {fields or 'none'}); pass --json-key NAME for the "
                        "field holding the text")
    return _check_text(record[key], location, key)


def _text_column(path: Path, names: Sequence[str], key: str) -> None:
    if key not in names:
        raise DataError(f"--input {path}: no {key!r} column (it has {list(names)}); pass --json-key NAME "
                        f"for the column holding the text")


def _iter_parquet(path: Path, key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--input {path}: reading parquet needs pyarrow; {_NEEDS_ARROW}") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise DataError(f"--input {path}: not a readable parquet file ({' '.join(str(error).split())[:200]})") \
            from None
    _text_column(path, parquet.schema_arrow.names, key)
    batches = (batch.column(0).to_pylist()
               for batch in parquet.iter_batches(batch_size=_ARROW_BATCH_ROWS, columns=[key]))
    yield from _rows(path, batches, key, "a parquet file whose data pages can be read")


def _damaged(path: Path, error: Exception, what: str) -> DataError:
    """A file pyarrow or datasets cannot read (truncated, overwritten, a piece missing), in one line
    naming the input: their own errors (ArrowInvalid, JSONDecodeError, FileNotFoundError of a
    shard) name neither the input nor what to do."""
    reason = " ".join(str(error).split())[:200]
    return DataError(f"--input {path}: damaged, not {what} ({type(error).__name__}: {reason}); "
                     f"write it again or leave it out")


def _rows(path: Path, batches: Iterator[list], key: str, what: str) -> Iterator[str]:
    """The text of each row of `batches`, checked; a read error on the way is one line naming `path`."""
    row = 0
    try:
        for values in batches:
            for value in values:
                row += 1
                yield _check_text(value, f"--input {path} row {row}", key)
    except DataError:
        raise
    except Exception as error:  # pyarrow's ArrowInvalid / OSError, datasets' own, mid-file
        raise _damaged(path, error, what) from None


def _iter_hf(path: Path, key: str, split: Optional[str]) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"--input {path}: reading a datasets directory needs datasets; {_NEEDS_ARROW}") from None
    what = "a datasets save_to_disk directory"
    try:
        loaded = datasets.load_from_disk(str(path))  # memory-mapped Arrow files, nothing downloaded
    except Exception as error:  # a damaged state.json or dataset_info.json, a shard missing or overwritten
        raise _damaged(path, error, what) from None
    if isinstance(loaded, datasets.DatasetDict):
        chosen = split or "train"
        if chosen not in loaded:
            raise DataError(f"--input {path}: no split {chosen!r} (it has {list(loaded)}); pass --split NAME")
        loaded = loaded[chosen]
    _text_column(path, loaded.column_names, key)
    batches = (batch[key] for batch in loaded.select_columns([key]).iter(batch_size=_ARROW_BATCH_ROWS))
    yield from _rows(path, batches, key, what)


def iter_documents(source: Source, key: str = "text", split: Optional[str] = None) -> Iterator[str | TextFile]:
    """The documents of one source, in order: the .txt file (a TextFile); each non-blank .jsonl line's
    `key` field; each .parquet or datasets row's `key` column."""
    if source.kind == "txt":
        yield TextFile(source.path)
    elif source.kind == "jsonl":
        yield from _iter_jsonl(source.path, key)
    elif source.kind == "parquet":
        yield from _iter_parquet(source.path, key)
    elif source.kind == "hf":
        yield from _iter_hf(source.path, key, split)
    else:
        raise DataError(f"--input {source.path}: unknown input kind {source.kind!r}")
