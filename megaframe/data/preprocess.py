"""Turn text (.txt, .jsonl, .parquet, local `datasets`) into an indexed token dataset: the logic behind
megaframe-preprocess (preprocess_cli.py).

With workers > 1, documents are tokenized in a process pool a chunk at a time while the parent writes
the tokens in input order. At most a few chunks per worker are in flight, so memory stays bounded
however large the input (Pool.imap would read the whole input ahead into its task queue).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import time
from collections import deque
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from megaframe.data.indexed import LAYOUTS, DataError, IndexedDatasetWriter, best_dtype
from megaframe.data.sources import find_sources, iter_documents
from megaframe.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["preprocess"]

_CHUNK_DOCUMENTS = 64  # documents per task sent to a worker: large enough to amortise the pickling
_CHUNKS_IN_FLIGHT_PER_WORKER = 4

_worker: Optional[tuple[Tokenizer, bool]] = None


def _document(tokenizer: Tokenizer, text: str, append_eod: bool) -> np.ndarray:
    """One document's token ids as an array: a worker sends it back as one buffer, where a list of
    Python ints would cost more to pickle than the byte tokenizer takes to make it."""
    ids = tokenizer.encode(text)
    if append_eod:
        ids.append(tokenizer.eod_id)
    return np.asarray(ids, dtype=np.int64)


def _start_worker(tokenizer_spec: str, append_eod: bool) -> None:
    global _worker
    _worker = (build_tokenizer(tokenizer_spec), append_eod)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    assert _worker is not None, "worker started without a tokenizer"
    tokenizer, append_eod = _worker
    return [_document(tokenizer, text, append_eod) for text in texts]


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    iterator = iter(texts)
    while chunk := list(itertools.islice(iterator, _CHUNK_DOCUMENTS)):
        yield chunk


def _encoded(texts: Iterable[str], tokenizer: Tokenizer, append_eod: bool, workers: int) -> Iterator[np.ndarray]:
    """Token ids of each text (end-of-document appended when asked), in input order."""
    if workers == 1:
        yield from (_document(tokenizer, text, append_eod) for text in texts)
        return
    # fork would copy a parent that may hold threads (tqdm's monitor, a tokenizer's pool); spawn is safe
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer.name, append_eod)) as pool:
        pending: deque = deque()
        for chunk in _chunks(texts):
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= workers * _CHUNKS_IN_FLIGHT_PER_WORKER:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


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
) -> dict[str, Any]:
    """Tokenize every document of `inputs` into OUTPUT_PREFIX.bin/.idx/.json; returns a summary dict.

    Each input document becomes one dataset document (empty ones included, so indices line up with
    the input). `layout` is "megatron" (Megatron-LM's MMIDIDX files plus megaframe's sidecar) or
    "megaframe" (the earlier MFTOKIDX). On any error the previous dataset at `output_prefix`, if any,
    is left intact. `progress`: a bar on stderr (None: only when stderr is a terminal).
    """
    started = time.perf_counter()
    if workers < 1:
        raise DataError(f"--workers {workers}: must be at least 1")
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer)
    sources = find_sources(inputs)
    if not sources:
        raise DataError("--input: no input files given")
    texts = (text for source in sources for text in iter_documents(source, json_key, split))
    with IndexedDatasetWriter(output_prefix, dtype=best_dtype(tokenizer.vocab_size), layout=layout) as writer, \
            tqdm(desc="tokenizing", unit=" docs", file=sys.stderr, disable=None if progress is None else not progress,
                 mininterval=1.0) as bar:
        for tokens in _encoded(texts, tokenizer, append_eod, workers):
            writer.add_document(tokens)
            bar.update(1)
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
                "source_files": [str(source.path) for source in sources],
            }
        )
        summary = {
            "output_prefix": str(output_prefix),
            "num_files": len(sources),
            "num_documents": writer.num_documents,
            "num_tokens": writer.num_tokens,
            "tokenizer": tokenizer.name,
            "layout": layout,
            "workers": workers,
        }
    summary["seconds"] = time.perf_counter() - started
    summary["tokens_per_second"] = summary["num_tokens"] / max(summary["seconds"], 1e-9)
    return summary
