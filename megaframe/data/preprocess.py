"""Turn text (.txt, .jsonl, .parquet, local `datasets`) into an indexed token dataset: the logic behind
megaframe-preprocess (preprocess_cli.py).

With workers > 1, documents are tokenized in a process pool a chunk at a time while the parent writes
the tokens in input order; a worker that dies ends the run in one line (Pool waited for its lost
task for good). At most a few chunks per worker are in flight, of a few MB of text each, so memory
stays bounded however large the input (Pool.imap would read the whole input ahead into its task
queue). A .txt file is read and tokenized in pieces (long_text.py); a large one's pieces are cut here,
shared by the workers, and written as they come back, so that the parent never holds its document whole.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from megaframe.common.launch_env import usable_cores
from megaframe.data.dataset import split_documents
from megaframe.data import megatron
from megaframe.data.indexed import LAYOUTS, DataError, IndexedDatasetWriter, best_dtype
from megaframe.data.preprocess_stop import Stopped, ignore_stop_in_worker, signals_deferred, stops_held_while_spawning
from megaframe.data.long_text import cut_text, encode_piece, encode_text_file, splits_text
from megaframe.data.sources import Source, TextFile, find_sources, iter_documents
from megaframe.data.temp_files import remove_orphans
from megaframe.data.tokenizer import Tokenizer, build_tokenizer, sidecar_record

__all__ = ["preprocess", "usable_workers"]

_CHUNK_DOCUMENTS = 64  # documents per task sent to a worker: large enough to amortise the pickling
_CHUNK_CHARS = 4 << 20  # text per task at most (a larger .txt file is cut into pieces: _pieces)
_CHUNKS_IN_FLIGHT_PER_WORKER = 4  # tasks sent ahead per worker, of at most this much text in all:
_CHARS_IN_FLIGHT_PER_WORKER = 4 * _CHUNK_CHARS  # (or one task a worker), whose tokens wait to be written

_worker: Optional[tuple[Tokenizer, bool]] = None


@dataclass(frozen=True)
class _Piece:
    """A piece of a large .txt file's one document, cut by the parent (long_text.cut_text) so that
    the workers tokenize the file together; `last` ends the document."""

    text: str
    last: bool


def _document(tokenizer: Tokenizer, text: str | TextFile | _Piece, append_eod: bool) -> np.ndarray:
    """One document's token ids as an array (or a piece's): a worker sends it back as one buffer,
    where a list of Python ints would cost more to pickle than the byte tokenizer takes to make it."""
    if isinstance(text, TextFile):
        return encode_text_file(tokenizer, text.path, tokenizer.eod_id if append_eod else None)
    if isinstance(text, _Piece):
        return encode_piece(tokenizer, text.text, tokenizer.eod_id if append_eod and text.last else None)
    ids = tokenizer.encode(text)
    if append_eod:
        ids.append(tokenizer.eod_id)
    return np.asarray(ids, dtype=np.int64)


def usable_workers(requested: int) -> tuple[int, Optional[str]]:
    """At most one worker per core this process may run on (os.sched_getaffinity: a SLURM job's or a
    container's share, not the whole machine): more only add processes that wait for a core, since
    the output is the same for any count. Returns the count and, when capped, a line saying so."""
    cores = usable_cores()
    if requested <= cores:
        return requested, None
    return cores, f"--workers {requested}: capped at {cores}, the cores this process may use (os.sched_getaffinity)"


def _start_worker(tokenizer_spec: str, append_eod: bool) -> None:
    global _worker
    ignore_stop_in_worker()
    _worker = (build_tokenizer(tokenizer_spec), append_eod)


def _encode_chunk(texts: list[str | TextFile | _Piece]) -> list[np.ndarray]:
    assert _worker is not None, "worker started without a tokenizer"
    tokenizer, append_eod = _worker
    return [_document(tokenizer, text, append_eod) for text in texts]


def _size(text: str | TextFile | _Piece) -> int:
    """A document's characters, or a .txt file's bytes (at least its characters)."""
    return text.path.stat().st_size if isinstance(text, TextFile) else len(getattr(text, "text", text))


def _pieces(texts: Iterable[str | TextFile], tokenizer: Tokenizer) -> Iterator[str | TextFile | _Piece]:
    """The documents, a .txt file larger than a task cut into _Pieces here (the cuts are checked with
    the parent's tokenizer: a few short encodes a piece), so the workers tokenize it together where
    one worker tokenized the whole file. A tokenizer that agrees on no cut gets the file whole, read by
    the worker (its text is not sent through a pipe)."""
    cuts = splits_text(tokenizer)
    for text in texts:
        if not isinstance(text, TextFile) or _size(text) <= _CHUNK_CHARS or not cuts:
            yield text
            continue
        pieces = cut_text(tokenizer, text.path)
        piece = next(pieces)
        for following in pieces:
            yield _Piece(piece, last=False)
            piece = following
        yield _Piece(piece, last=True)


def _chunks(texts: Iterable[str | TextFile | _Piece]) -> Iterator[tuple[list[str | TextFile | _Piece], int]]:
    """The documents in tasks of at most _CHUNK_DOCUMENTS and _CHUNK_CHARS (or one document), with
    their size: a directory of large .txt files is not sent to one worker 64 files at a time."""
    chunk: list[str | TextFile | _Piece] = []
    size = 0
    for text in texts:
        n = _size(text)
        if chunk and (len(chunk) == _CHUNK_DOCUMENTS or size + n > _CHUNK_CHARS):
            yield chunk, size
            chunk, size = [], 0
        chunk.append(text)
        size += n
    if chunk:
        yield chunk, size


def _encoded(texts: Iterable[str | TextFile], tokenizer: Tokenizer, append_eod: bool,
             workers: int) -> Iterator[tuple[np.ndarray, bool]]:
    """Token ids of each text (end-of-document appended when asked), in input order, a large .txt
    file's a piece at a time: (tokens, whether they end the document)."""
    if workers == 1:
        yield from ((_document(tokenizer, text, append_eod), _ends(text)) for text in _pieces(texts, tokenizer))
        return
    # fork would copy a parent that may hold threads (tqdm's monitor, a tokenizer's pool); spawn is safe.
    # An executor, not multiprocessing.Pool: a worker that dies (the OOM killer, on a long document)
    # breaks it and every waiting result raises, where Pool lost the task and its result waited forever
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(tokenizer.name, append_eod))
    try:
        pending: deque = deque()  # (future, its items, their text's size), in input order
        in_flight = 0
        for chunk, size in _chunks(_pieces(texts, tokenizer)):
            # a few tasks a worker, of a bounded size in all; but one a worker whatever their size (a
            # directory of large files for a tokenizer that cuts none: one worker each, not one in all)
            while len(pending) >= workers and (len(pending) >= workers * _CHUNKS_IN_FLIGHT_PER_WORKER
                                               or in_flight + size > workers * _CHARS_IN_FLIGHT_PER_WORKER):
                done, items, done_size = pending.popleft()
                in_flight -= done_size
                yield from zip(done.result(), map(_ends, items))
            with stops_held_while_spawning():  # submit may spawn a worker
                pending.append((pool.submit(_encode_chunk, chunk), chunk, size))  # raises once the pool is broken
            in_flight += size
        while pending:
            done, items, _ = pending.popleft()
            yield from zip(done.result(), map(_ends, items))
    except BrokenProcessPool:
        raise DataError("--workers: a tokenizer worker died (killed, out of memory on a long document?); run again "
                        "with fewer --workers, or split the input into smaller documents") from None
    finally:
        # on a stop or an error the queued chunks are dropped and the workers finish the ones in hand
        # (stop signals are theirs to ignore): terminating them could leave a result half sent, and
        # the executor's reader waiting on it for good (reproduced by review)
        pool.shutdown(wait=True, cancel_futures=True)


def _ends(item: str | TextFile | _Piece) -> bool:
    """Whether a task's item ends its document (all but a _Piece that is not its file's last)."""
    return not isinstance(item, _Piece) or item.last


def preprocess(
    inputs: Sequence[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    tokenizer: Tokenizer | str = "byte",
    json_key: str = "text",
    append_eod: bool = True,
    layout: str = LAYOUTS[0],
    workers: int = 1,
    split: Optional[str] = None,
    progress: Optional[bool] = None,
    valid_fraction: float = 0.0,
    valid_prefix: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Tokenize every document of `inputs` into OUTPUT_PREFIX.bin/.idx/.json; returns a summary dict.

    Each input document becomes one dataset document (empty ones included, so indices line up with
    the input). `layout` is "megatron" (Megatron-LM's MMIDIDX files plus megaframe's sidecar) or
    "megaframe" (the earlier MFTOKIDX). On any error the previous dataset at `output_prefix`, if any,
    is left intact. `progress`: a bar on stderr (None: only when stderr is a terminal). `workers` is
    capped at the cores this process may use (usable_workers). Temp files that a killed run left
    for these prefixes are removed first (temp_files.py).

    valid_fraction > 0 holds out the end of the input and writes it to `valid_prefix` (default
    OUTPUT_PREFIX_val), the rest to `output_prefix`: nanoGPT's train.bin and val.bin. Of several
    documents, the last ceil(f x documents), whole, as data.valid_fraction holds out; of a single
    document, the last f of its tokens (nanoGPT's data[int(n*0.9):]), both parts ending with the
    end-of-document token. The input is then read twice (first to count its documents).
    """
    started = time.perf_counter()
    if workers < 1:
        raise DataError(f"--workers {workers}: must be at least 1")
    workers = usable_workers(workers)[0]
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"--valid-fraction {valid_fraction}: must be at least 0 and below 1 (0.1 holds out 10%)")
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer)
    made_by = sidecar_record(tokenizer)  # the files' hash as they loaded, before hours of tokenizing
    sources = find_sources(inputs)
    if not sources:
        raise DataError("--input: no input files given")
    # where the training part ends, as a document position (data/dataset.py); inf: nothing held out
    boundary = (split_documents(_count_documents(sources, json_key, split), valid_fraction)[0][1]
                if valid_fraction else math.inf)
    texts = (text for source in sources for text in iter_documents(source, json_key, split))
    prefixes = [output_prefix] if not valid_fraction else [output_prefix, valid_prefix or f"{output_prefix}_val"]
    if len({Path(prefix).resolve() for prefix in prefixes}) < len(prefixes):
        raise DataError(f"--valid-output-prefix {valid_prefix}: is --output-prefix too; name another for the held-out part")
    orphans = [path for prefix in prefixes for path in remove_orphans(Path(prefix))]
    published: list[str] = []  # the prefixes moved into place: a stop after that finds them complete
    with _noting_published(published), contextlib.ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(prefix, dtype=best_dtype(tokenizer.vocab_size),
                                                            layout=layout)) for prefix in prefixes]
        bar = stack.enter_context(tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, mininterval=1.0,
                                       disable=None if progress is None else not progress))
        # closed with the stack: a stop signal terminates the worker pool before this returns
        encoded = stack.enter_context(contextlib.closing(_encoded(texts, tokenizer, append_eod, workers)))
        index = 0  # of the document the tokens belong to
        for tokens, last in encoded:
            _add(writers, index, tokens, last, boundary, tokenizer.eod_id if append_eod else None, valid_fraction)
            index += last
            bar.update(int(last))
        _check_written(writers, inputs, valid_fraction, append_eod)
        metadata = {**made_by, "append_eod": append_eod, "json_key": json_key,
                    "source_files": [str(source.path) for source in sources]}
        for writer in writers:  # every dataset complete on disk before any replaces a previous one
            writer.prepare(metadata)
        with signals_deferred():  # a stop signal waits until the datasets are in place (preprocess_stop.py)
            _publish(writers, published)
        summary: dict[str, Any] = {
            "output_prefix": str(output_prefix),
            "num_files": len(sources),
            "num_documents": writers[0].num_documents,
            "num_tokens": writers[0].num_tokens,
            "tokenizer": made_by["tokenizer"],
            "layout": layout,
            "workers": workers,
            "orphans_removed": len(orphans),
        }
        if valid_fraction:
            summary["valid"] = {"output_prefix": str(prefixes[1]), "num_documents": writers[1].num_documents,
                                "num_tokens": writers[1].num_tokens, "valid_fraction": valid_fraction}
    summary["seconds"] = time.perf_counter() - started
    tokens_written = sum(part["num_tokens"] for part in (summary, summary.get("valid", {"num_tokens": 0})))
    summary["tokens_per_second"] = tokens_written / max(summary["seconds"], 1e-9)
    return summary


@contextlib.contextmanager
def _noting_published(published: list[str]) -> Iterator[None]:
    """A Stopped raised within the block carries the prefixes already moved into place (Stopped.written)."""
    try:
        yield
    except Stopped as stop:
        stop.written = list(published)
        raise


def _publish(writers: list[IndexedDatasetWriter], published: list[str]) -> None:
    """Move the prepared datasets into place, the training set first: three renames each, which
    rarely fail once the files are written. If the held-out set's fail, the pair no longer matches
    and the error says so (its .json is removed first, so it will not load unnoticed)."""
    for writer in writers:
        try:
            writer.commit()
        except OSError as err:
            if not published:  # its renames began by removing the old .json: "untouched" would be untrue
                raise DataError(f"moving {writer.prefix} into place failed ({err.strerror or err}): a dataset "
                                f"that was there may be incomplete now (its .json goes first, so it will not load "
                                f"unnoticed); run megaframe-preprocess again") from err
            raise DataError(f"{published[0]} was replaced, but moving {writer.prefix} into place failed "
                            f"({err.strerror or err}): the two no longer match; run megaframe-preprocess again") from err
        published.append(str(writer.prefix))


def _add(writers: list[IndexedDatasetWriter], index: int, tokens: np.ndarray, last: bool, boundary: float,
         eod_id: Optional[int], valid_fraction: float) -> None:
    """Tokens of document `index` (a piece of it unless `last`) to the training writer, or the
    held-out one; the document the boundary falls inside (a single document) is written to the
    training writer, then its text split as nanoGPT's prepare.py splits it, each part ending a document."""
    writer = writers[1] if index >= boundary else writers[0]
    writer.add_part(tokens)
    # refused as it grows, not once the whole input is tokenized; the document the held-out split cuts
    # in two (a single .txt) counts by its larger part, which grows with it
    split = index < boundary < index + 1
    larger_part = max(boundary - index, 1 - boundary + index) if split else 1
    # a part the split makes ends with an end-of-document token of its own
    if writer.layout == "megatron" and writer.open_tokens * larger_part + split > megatron.MAX_DOCUMENT_TOKENS:
        raise DataError(f"document {index + 1} of the inputs holds more than {megatron.MAX_DOCUMENT_TOKENS:,} "
                        "tokens, more than Megatron's index can record for one document; split it, or write "
                        "--format megaframe")
    if not last:
        return
    if split:
        _split_document(writers, boundary - index, eod_id, valid_fraction)
    else:
        writer.end_document()


def _split_document(writers: list[IndexedDatasetWriter], kept_fraction: float, eod_id: Optional[int],
                    valid_fraction: float) -> None:
    """The training writer's open document: its text's last (1 - kept_fraction) of tokens moved to the
    held-out writer, read back from the temp file (never held whole), each part ending a document."""
    train, valid = writers
    text_size = train.open_tokens - (eod_id is not None)
    cut = int(kept_fraction * text_size)  # < text_size: the held-out part keeps a token
    if cut == 0:
        raise DataError(f"--valid-fraction {valid_fraction} leaves no training text of the input's "
                        f"{text_size} tokens; give more text or a smaller fraction")
    for tokens in train.open_document_tokens(cut):  # the end-of-document token too, when appended
        valid.add_part(tokens)
    valid.end_document()
    train.truncate_open_document(cut)
    if eod_id is not None:
        train.add_part(np.asarray([eod_id]))
    train.end_document()


def _count_documents(sources: list[Source], json_key: str, split: Optional[str]) -> int:
    """The inputs' documents, counted in a first pass (read, not tokenized) so that the held-out
    part can be written as the documents stream by."""
    return sum(1 for source in sources for _ in iter_documents(source, json_key, split))


def _check_written(writers: list[IndexedDatasetWriter], inputs: Sequence[Any], valid_fraction: float,
                   append_eod: bool = True) -> None:
    """DataError for an output without tokens of text (an empty input, documents that are all empty:
    end-of-document tokens alone, which training then refused), or a held-out part rounded to nothing."""
    documents = sum(writer.num_documents for writer in writers)
    text_tokens = sum(writer.num_tokens for writer in writers) - (documents if append_eod else 0)
    if writers[0].num_documents == 0 or text_tokens == 0:
        raise DataError(
            f"--input {' '.join(str(raw) for raw in inputs)}: produced no tokens of text "
            f"({writers[0].num_documents} documents{', all empty' if documents else ''}); check the files and "
            f"--json-key"
        )
    for writer, part in zip(writers if len(writers) == 2 else [], ("training", "validation")):
        if writer.num_tokens == 0:
            raise DataError(f"--valid-fraction {valid_fraction} leaves no {part} tokens ({writers[0].num_tokens} "
                            f"training, {writers[1].num_tokens} validation); give more text or another fraction")
