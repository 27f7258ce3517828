"""Megatron-LM's indexed dataset (`MMIDIDX`, what its tools/preprocess_data.py and
IndexedDatasetBuilder write, also GPT-NeoX's and Megatron-DeepSpeed's), read in place.

PREFIX.idx, little-endian:
  magic b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B, sequence count S <Q, document count D <Q
  (the length of the document index, one more than the documents), S int32 sequence lengths (tokens),
  S int64 sequence pointers (byte offsets into PREFIX.bin), D int64 document indices (the first
  sequence of each document, then S); multimodal files add S int8 sequence modes.
PREFIX.bin: the sequences' tokens back to back.

A megaframe document is a Megatron document (its sequences, which the builder stores one after the
other). The files carry no tokenizer: the vocabulary and end-of-document id come from data.tokenizer,
unless megaframe wrote them, with its PREFIX.json sidecar (format "megatron": tokenizer, vocabulary,
end-of-document id, counts, the index's size and a build checksum). Megatron's reader ignores the sidecar.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from megaframe.common import json_text
from megaframe.config.sidecar_fields import field_problem
from megaframe.data.index_scan import DocumentOffsets, nondecreasing, scan_sequences, walked_once
from megaframe.data.mapped import MappedFiles
from megaframe.data.token_files import DataError, content_checksum, read_head

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
# Megatron's DType codes
DTYPES: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
                               5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2")}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
_FIX = "rebuild it with Megatron's tools/preprocess_data.py or megaframe-preprocess"


WRITE_CHUNK = 1 << 22  # documents per slice of the index written at a time
MAX_DOCUMENT_TOKENS = int(np.iinfo(np.int32).max)  # a document is one sequence, its length an int32


def write_index(idx_file: BinaryIO, dtype: np.dtype, doc_offsets: np.ndarray) -> None:
    """Megatron's index of documents whose tokens lie back to back in the .bin, one sequence per
    document, as its IndexedDatasetBuilder writes them (`doc_offsets`: D + 1 token offsets). Written
    a slice at a time: the lengths, pointers and document index made whole held 20 bytes a document
    on top of the offsets (tracemalloc), 40 GB at the end of preprocessing two billion documents."""
    count = len(doc_offsets) - 1  # sequences (one per document); the document index holds 0, 1, ..., D
    idx_file.write(_HEADER.pack(MAGIC, 1, _CODES[np.dtype(dtype)], count, count + 1))
    for start in range(0, count, WRITE_CHUNK):
        lengths = np.diff(doc_offsets[start:start + WRITE_CHUNK + 1])
        if int(lengths.max()) > MAX_DOCUMENT_TOKENS:
            raise DataError(f"a document holds more than {MAX_DOCUMENT_TOKENS:,} tokens, more than Megatron's index "
                            "can record for one document; split it, or write --format megaframe")
        idx_file.write(lengths.astype("<i4").tobytes())
    itemsize = np.dtype(dtype).itemsize
    for start in range(0, count, WRITE_CHUNK):  # byte pointers
        idx_file.write((doc_offsets[start:min(start + WRITE_CHUNK, count)].astype("<i8") * itemsize).tobytes())
    for start in range(0, count + 1, WRITE_CHUNK):
        idx_file.write(np.arange(start, min(start + WRITE_CHUNK, count + 1), dtype="<i8").tobytes())


def read_sidecar(prefix: str | os.PathLike[str]) -> Optional[dict[str, Any]]:
    """megaframe's PREFIX.json next to a Megatron dataset, or None when there is none (or it is not
    megaframe's: it does not say format "megatron")."""
    path = Path(f"{prefix}.json")
    if not path.is_file():
        return None
    try:
        sidecar = json_text.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"data.path={prefix}: {path} is not valid JSON ({error}); delete it or {_FIX}") from None
    return sidecar if isinstance(sidecar, dict) and sidecar.get("format") == "megatron" else None


class MegatronDataset:
    """Read-only, memory-mapped Megatron dataset with the interface of megaframe's IndexedDataset
    (tokens, doc_offsets, documents, vocab_size, eod_id)."""

    def __init__(self, prefix: str | os.PathLike[str], vocab_size: Optional[int] = None,
                 eod_id: Optional[int] = None, vocab_source: str = "data.tokenizer's") -> None:
        """Open PREFIX.bin/.idx; the vocabulary comes from megaframe's sidecar when there is one, else
        from `vocab_size` and `eod_id`."""
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path = Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise self._error(f"{path} not found; {_FIX}")
        self.files = MappedFiles()  # checked before every batch: see mapped.py
        self.dtype, lengths, pointers, doc_index = self._read_index()
        if not np.issubdtype(self.dtype, np.integer):
            raise self._error(f"{self.idx_path} holds {self.dtype} values, not token ids; {_FIX}")
        bin_bytes = self.bin_path.stat().st_size
        item = self.dtype.itemsize
        # a chunk at a time, once a process (index_scan.py)
        scan = walked_once((self.idx_path, self.bin_path), "sequences", lambda: scan_sequences(lengths, pointers, item))
        if scan.negative_length:
            raise self._error(f"{self.idx_path} holds negative sequence lengths (corrupt); {_FIX}")
        if scan.max_end > bin_bytes or scan.min_pointer < 0:
            raise self._error(f"{self.idx_path} points past the end of {self.bin_path} ({bin_bytes} bytes; "
                              f"truncated, or the two files are from different builds); {_FIX}")
        # Megatron's builder writes exactly the indexed sequences: a longer .bin is another build's
        # (a newer .bin beside the old .idx, as a crash in the middle of replacing both leaves them)
        if bin_bytes != scan.last_end:
            raise self._error(f"{self.bin_path} holds {bin_bytes} bytes where {self.idx_path} accounts for "
                              f"{scan.last_end}: the two files are from different builds; {_FIX}")
        # megaframe reads the tokens as one stream: the sequences must lie back to back, in order
        if not scan.back_to_back:
            raise self._error(f"{self.idx_path}: the sequences are not stored back to back in {self.bin_path}; "
                              f"megaframe reads datasets as IndexedDatasetBuilder writes them")
        if len(doc_index) == 0 or doc_index[0] != 0 or doc_index[-1] != len(lengths) or \
                not walked_once((self.idx_path,), "documents in order", lambda: nondecreasing(doc_index)):
            raise self._error(f"{self.idx_path}: its document index does not run from 0 to the {len(lengths)} "
                              f"sequences in order (corrupt); {_FIX}")
        total = scan.last_end // item
        self.doc_offsets = DocumentOffsets(pointers, doc_index, item, total)  # token offset of every boundary
        self.tokens = self.files.array(self.bin_path, self.dtype, count=total)
        self.sidecar = read_sidecar(self.prefix)
        if self.sidecar is not None:
            self._check_sidecar()
            vocab_size, eod_id = self.sidecar["vocab_size"], self.sidecar["eod_id"]
            vocab_source = f"the tokenizer's, recorded in {self.prefix}.json"
            self.checksum = bytes.fromhex(self.sidecar["checksum"])
        else:
            if vocab_size is None or eod_id is None:
                raise self._error(f"{self.idx_path} names no tokenizer and there is no {self.prefix}.json sidecar; "
                                  f"set data.tokenizer to the tokenizer it was built with")
            # no build checksum in Megatron's files: the index header and sizes identify the build
            self.checksum = hashlib.blake2b(read_head(self.idx_path, 1 << 16) + f"{self.idx_path.stat().st_size}-"
                                            f"{bin_bytes}".encode(), digest_size=16).digest()
        self._vocab_size, self._eod_id = int(vocab_size), int(eod_id)
        self.vocab_source = vocab_source  # where the vocabulary came from, for error messages
        self.metadata = {**(self.sidecar or {}), "format": "megatron", "vocab_size": self._vocab_size,
                         "eod_id": self._eod_id, "num_documents": len(self), "num_tokens": total}

    def _check_sidecar(self) -> None:
        sidecar, json_path = self.sidecar, f"{self.prefix}.json"
        missing = [key for key in ("vocab_size", "eod_id", "checksum", "num_documents", "num_tokens", "index_bytes")
                   if key not in sidecar]
        if missing:
            raise self._error(f"{json_path} lacks {missing}; {_FIX}")
        if problem := field_problem(sidecar, self.dtype):
            raise self._error(f"{json_path}: {problem} (damaged or edited); {_FIX}")
        if (sidecar["num_documents"], sidecar["num_tokens"], sidecar["index_bytes"]) != \
                (len(self), self.num_tokens, self.idx_path.stat().st_size):
            raise self._error(f"{json_path} belongs to a different build than {self.idx_path} (its document, "
                              f"token or index-size counts disagree); {_FIX}")

    def _error(self, detail: str) -> DataError:
        return DataError(f"data.path={self.prefix}: {detail}")

    def _read_index(self) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
        size = self.idx_path.stat().st_size
        header = read_head(self.idx_path, _HEADER.size)
        if len(header) < _HEADER.size:
            raise self._error(f"{self.idx_path} is truncated ({len(header)} bytes, a header needs {_HEADER.size}); {_FIX}")
        magic, version, code, sequences, documents = _HEADER.unpack(header)
        if magic != MAGIC:
            raise self._error(f"{self.idx_path} is not a Megatron index (bad magic bytes); {_FIX}")
        if version != 1:
            raise self._error(f"{self.idx_path} has index version {version}; megaframe reads Megatron's version 1")
        if code not in DTYPES:
            raise self._error(f"{self.idx_path} has unknown dtype code {code} (corrupt); {_FIX}")
        needed = _HEADER.size + 12 * sequences + 8 * documents
        if size not in (needed, needed + sequences):  # + the int8 modes of a multimodal file
            raise self._error(f"{self.idx_path} holds {size} bytes, {needed} expected for {sequences} sequences and "
                              f"{documents - 1} documents (truncated or corrupt); {_FIX}")
        lengths = self.files.array(self.idx_path, "<i4", _HEADER.size, sequences)
        pointers = self.files.array(self.idx_path, "<i8", _HEADER.size + 4 * sequences, sequences)
        doc_index = self.files.array(self.idx_path, "<i8", _HEADER.size + 12 * sequences, documents)
        return DTYPES[code], lengths, pointers, doc_index

    @property
    def num_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def __len__(self) -> int:
        """Number of documents."""
        return len(self.doc_offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        """Tokens of document `index` (a read-only view into the map)."""
        position = int(index) + (len(self) if int(index) < 0 else 0)
        if not 0 <= position < len(self):
            raise IndexError(f"document {index} out of range for {len(self)} documents in {self.prefix}")
        return self.tokens[self.doc_offsets[position]: self.doc_offsets[position + 1]]

    def check_files(self) -> None:
        """DataError when a file has shrunk since it was opened (mapped.py): read, it would kill the run."""
        if shrunk := self.files.shrunk():
            raise self._error(shrunk)

    def verify(self) -> None:
        """Re-hash the tokens and document offsets against the sidecar's build checksum. Without a
        sidecar (a file Megatron wrote) there is no checksum: the checks of opening are all there is."""
        if self.sidecar is not None and content_checksum(self.tokens, self.doc_offsets) != self.checksum:
            raise self._error(f"{self.bin_path} or {self.idx_path} content does not match the checksum in "
                              f"{self.prefix}.json (corrupt); {_FIX}")

    def __reduce__(self):
        return MegatronDataset, (str(self.prefix), self._vocab_size, self._eod_id, self.vocab_source)

    def __repr__(self) -> str:
        return f"MegatronDataset({str(self.prefix)!r}, documents={len(self)}, tokens={self.num_tokens})"
