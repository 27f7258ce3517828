"""Memory-mapped token datasets: PREFIX.bin (tokens), PREFIX.idx (document offsets), PREFIX.json (metadata).

The writer's default layout is Megatron-LM's (MMIDIDX .idx, megatron.py), which Megatron, GPT-NeoX and
Megatron-DeepSpeed read as is; megaframe's JSON sidecar adds what Megatron's files lack (tokenizer,
vocabulary, end-of-document id, a build checksum). megaframe's earlier MFTOKIDX layout (read here by
IndexedDataset) stays readable and writable with layout="megaframe"."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Iterator, Optional, Sequence

import numpy as np

from megaframe.common import json_text
from megaframe.config.sidecar_fields import field_problem
from megaframe.data.index_scan import nondecreasing, walked_once
from megaframe.data.mapped import MappedFiles
from megaframe.data.megatron import write_index
from megaframe.data.temp_files import open_temp
from megaframe.data.token_files import DataError, content_checksum, read_head

__all__ = ["DataError", "IndexedDataset", "IndexedDatasetWriter", "LAYOUTS", "best_dtype", "umask_permissions"]


FORMAT_VERSION = 1
MAGIC = b"MFTOKIDX"
# magic, version, dtype code, num_docs, checksum; 40 bytes keeps the int64 offsets 8-byte aligned.
_HEADER = struct.Struct("<8sIIQ16s")
# Explicit little-endian so a dataset built on one machine reads the same on any other.
_DTYPE_BY_CODE: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_CODE_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in _DTYPE_BY_CODE.items()}
_REQUIRED_METADATA = ("tokenizer", "vocab_size", "eod_id")
_REBUILD_HINT = "build it with megaframe-preprocess"
LAYOUTS = ("megatron", "megaframe")  # on-disk layouts the writer produces; the first is the default


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest on-disk token dtype that holds every id below `vocab_size` (uint16 or int32)."""
    if vocab_size < 1:
        raise DataError(f"vocab_size={vocab_size}: must be positive; check the tokenizer")
    if vocab_size <= 1 << 16:
        return _DTYPE_BY_CODE[1]
    if vocab_size <= np.iinfo(np.int32).max:
        return _DTYPE_BY_CODE[2]
    raise DataError(f"vocab_size={vocab_size}: too large for int32 token ids; use a smaller vocabulary")


def _file_names(prefix: Path) -> tuple[Path, Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx"), Path(f"{prefix}.json")


def _canonical_dtype(dtype: Any) -> np.dtype:
    requested = np.dtype(dtype)
    for supported in _CODE_BY_DTYPE:
        if requested.kind == supported.kind and requested.itemsize == supported.itemsize:
            return supported
    raise DataError(f"dtype={requested}: unsupported token dtype; use numpy.uint16 or numpy.int32")


def umask_permissions(mode: int) -> int:
    """`mode` filtered by the process umask: the permissions open() would have given a new file."""
    # mkstemp/mkdtemp create owner-only entries; datasets are usually shared, so restore the usual bits.
    current_umask = os.umask(0)
    os.umask(current_umask)
    return mode & ~current_umask


def _fsync_dir(directory: Path) -> None:
    # Without this, a power loss right after os.replace can forget the rename itself.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class IndexedDatasetWriter:
    """Streams documents to PREFIX.bin/.idx/.json; nothing appears under those names until finalize()."""

    def __init__(self, prefix: str | os.PathLike[str], dtype: Any = np.uint16, layout: str = LAYOUTS[0]) -> None:
        """Open a temp .bin next to `prefix`; tokens are written there as documents arrive."""
        if layout not in LAYOUTS:
            raise DataError(f"--format {layout}: unknown dataset layout; use one of {list(LAYOUTS)}")
        self.prefix = Path(prefix)
        self.layout = layout
        self.dtype = _canonical_dtype(dtype)
        self.directory = self.prefix.parent
        self.directory.mkdir(parents=True, exist_ok=True)
        # array('q') costs 8 bytes per document, unlike a list of Python ints.
        self._offsets = array("q", [0])
        self._max_token = -1
        self._hasher = hashlib.blake2b(digest_size=16)
        self._open_tokens = 0  # of a document added in parts and not yet ended (add_part)
        self._hasher_at_open: Optional[Any] = None  # the hash before that document: truncate_open_document
        self._temp_paths: list[Path] = []
        self._bin_file = self._open_temp("bin")
        self._state = "open"

    def _open_temp(self, suffix: str) -> BinaryIO:
        # Same directory as the final file so os.replace is an atomic rename, never a copy.
        fd, temp_path = open_temp(self.directory, self.prefix.name, suffix)
        self._temp_paths.append(temp_path)
        return os.fdopen(fd, "wb")

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return self._offsets[-1]

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document's token ids to the temp .bin."""
        if self._hasher_at_open is not None:
            raise DataError(f"{self.prefix}: a document added in parts is open; call end_document() first")
        self._write(tokens)
        self.end_document()

    def add_part(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append token ids to the open document (end_document ends it): a document streamed in
        pieces is never held whole, which a .txt of many GB would need."""
        at_open = self._hasher.copy() if self._hasher_at_open is None else self._hasher_at_open  # a first part
        self._write(tokens)
        self._hasher_at_open = at_open  # once written: refused tokens begin no document

    def end_document(self) -> None:
        """End the document that add_part began (an empty one if none was begun)."""
        self._check_open()
        self._offsets.append(self._offsets[-1] + self._open_tokens)
        self._open_tokens = 0
        self._hasher_at_open = None

    @property
    def open_tokens(self) -> int:
        """Tokens of the document begun by add_part and not yet ended."""
        return self._open_tokens

    def open_document_tokens(self, start: int, chunk_tokens: int = 1 << 22) -> Iterator[np.ndarray]:
        """The open document's tokens from `start` on, read back from the temp .bin a chunk at a time."""
        self._check_open()
        self._bin_file.flush()
        itemsize = self.dtype.itemsize
        with open(self._temp_paths[0], "rb") as file:
            file.seek((self._offsets[-1] + start) * itemsize)
            for _ in range(start, self._open_tokens, chunk_tokens):
                yield np.frombuffer(file.read(chunk_tokens * itemsize), dtype=self.dtype)

    def truncate_open_document(self, keep: int) -> None:
        """Keep the open document's first `keep` tokens (the rest is dropped from the .bin and the
        checksum, whose state before the document is restored and the kept tokens hashed again)."""
        self._check_open()
        if not 0 <= keep <= self._open_tokens or self._hasher_at_open is None:
            raise DataError(f"{self.prefix}: cannot keep {keep} of the open document's {self._open_tokens} tokens")
        hasher, left = self._hasher_at_open.copy(), keep
        for tokens in self.open_document_tokens(0):
            kept = tokens[:left]
            hasher.update(kept.tobytes())
            left -= kept.size
            if not left:
                break
        self._bin_file.truncate((self._offsets[-1] + keep) * self.dtype.itemsize)
        self._bin_file.seek(0, os.SEEK_END)  # truncate leaves the position where it was
        self._hasher, self._open_tokens = hasher, keep

    def _check_open(self) -> None:
        if self._state != "open":
            raise DataError(f"{self.prefix}: writer is already {self._state}; create a new IndexedDatasetWriter")

    def _write(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Validate token ids and append them to the temp .bin and the checksum."""
        self._check_open()
        token_array = np.asarray(tokens)
        if token_array.ndim != 1:
            raise DataError(
                f"{self.prefix}: a document must be a 1-D sequence of token ids, got shape {token_array.shape}"
            )
        if token_array.size:
            if not np.issubdtype(token_array.dtype, np.integer):
                raise DataError(f"{self.prefix}: token ids must be integers, got {token_array.dtype}")
            smallest, largest = int(token_array.min()), int(token_array.max())
            # A silent cast would wrap out-of-range ids into wrong-but-valid tokens.
            if smallest < 0 or largest > np.iinfo(self.dtype).max:
                raise DataError(
                    f"{self.prefix}: token id {smallest if smallest < 0 else largest} does not fit {self.dtype}; "
                    "pick the dtype with best_dtype(vocab_size)"
                )
            self._max_token = max(self._max_token, largest)
        payload = token_array.astype(self.dtype, copy=False).tobytes()
        self._bin_file.write(payload)
        self._hasher.update(payload)
        self._open_tokens += token_array.size

    def _check_metadata(self, metadata: dict[str, Any]) -> None:
        missing = [key for key in _REQUIRED_METADATA if key not in metadata]
        if missing:
            raise DataError(
                f"{self.prefix}: finalize() metadata lacks {missing}; pass the tokenizer's name, vocab_size and eod_id"
            )
        vocab_size, eod_id = int(metadata["vocab_size"]), int(metadata["eod_id"])
        if self._max_token >= vocab_size or not 0 <= eod_id < vocab_size:
            raise DataError(
                f"{self.prefix}: token id {max(self._max_token, eod_id)} >= vocab_size={vocab_size}; "
                "the metadata does not match the tokenizer that produced the tokens"
            )

    def _complete_metadata(self, metadata: dict[str, Any], checksum: bytes) -> dict[str, Any]:
        return {
            **metadata,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "dtype": self.dtype.name,
            "format": self.layout,
            "format_version": FORMAT_VERSION,
            "checksum": checksum.hex(),
        }

    def _write_index(self, idx_file: BinaryIO, offsets: np.ndarray, checksum: bytes) -> None:
        if self.layout == "megatron":
            write_index(idx_file, self.dtype, offsets)
            return
        idx_file.write(_HEADER.pack(MAGIC, FORMAT_VERSION, _CODE_BY_DTYPE[self.dtype], self.num_documents, checksum))
        idx_file.write(offsets.tobytes())

    def finalize(self, metadata: dict[str, Any]) -> Path:
        """Write .idx and .json, then atomically move all three files into place; returns the prefix."""
        self.prepare(metadata)
        return self.commit()

    def commit(self) -> Path:
        """Move the files that prepare() completed into place (three renames); returns the prefix.
        Apart from prepare, so that a pair (train and validation sets) is published only once both
        are complete: a failure while preparing the second leaves both previous datasets as they were."""
        if self._state != "prepared":
            raise DataError(f"{self.prefix}: writer is {self._state}, not prepared; call prepare() first")
        try:
            self._commit()
        except BaseException:
            self.abort()
            raise
        self._state = "finalized"
        return self.prefix

    def prepare(self, metadata: dict[str, Any]) -> None:
        """Write .idx and .json beside the .bin, all three under temporary names, synced to disk."""
        if self._state != "open":
            raise DataError(f"{self.prefix}: writer is already {self._state}; create a new IndexedDatasetWriter")
        if self._open_tokens or self._hasher_at_open is not None:
            raise DataError(f"{self.prefix}: a document added in parts was not ended; call end_document() first")
        if self.num_documents == 0:
            raise DataError(f"{self.prefix}: no documents were added; nothing to write")
        # Checked before touching the files so a caller can fix the metadata and call finalize() again.
        self._check_metadata(metadata)
        try:
            self._bin_file.flush()
            os.fsync(self._bin_file.fileno())
            self._bin_file.close()
            offsets = np.frombuffer(self._offsets, dtype=np.int64).astype("<i8", copy=False)
            self._hasher.update(offsets)  # its buffer: tobytes() copied 8 bytes a document
            checksum = self._hasher.digest()
            with self._open_temp("idx") as idx_file:
                self._write_index(idx_file, offsets, checksum)
                idx_file.flush()
                os.fsync(idx_file.fileno())
                # the sidecar names the index's size: a cheap check, at open, that the two belong together
                index_bytes = idx_file.tell()
            complete = {**self._complete_metadata(metadata, checksum), "index_bytes": index_bytes}
            metadata_text = json.dumps(complete, indent=2, sort_keys=True) + "\n"
            with self._open_temp("json") as json_file:
                json_file.write(metadata_text.encode("utf-8"))
                json_file.flush()
                os.fsync(json_file.fileno())
        except BaseException:
            self.abort()
            raise
        self._state = "prepared"

    def _commit(self) -> None:
        bin_temp, idx_temp, json_temp = self._temp_paths
        file_mode = umask_permissions(0o666)
        for temp_path in self._temp_paths:
            os.chmod(temp_path, file_mode)
        bin_path, idx_path, json_path = _file_names(self.prefix)
        # The .json is the commit marker: drop the old one first so a crash midway through the
        # swap leaves "no dataset" (a clear error) rather than an old .json over new .bin/.idx.
        json_path.unlink(missing_ok=True)
        os.replace(bin_temp, bin_path)
        os.replace(idx_temp, idx_path)
        os.replace(json_temp, json_path)
        self._temp_paths.clear()
        _fsync_dir(self.directory)

    def abort(self) -> None:
        """Discard everything written so far; files under the final names are left untouched."""
        if self._state == "finalized":
            return
        self._bin_file.close()
        for temp_path in self._temp_paths:
            temp_path.unlink(missing_ok=True)
        self._temp_paths.clear()
        self._state = "aborted"

    def __enter__(self) -> IndexedDatasetWriter:
        """Use as a context manager so an exception (or a missing finalize) cleans up the temp files."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Abort unless finalize() already committed the dataset."""
        self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of a dataset written by IndexedDatasetWriter."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        """Open PREFIX.bin/.idx/.json and check that they are complete and belong together."""
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path, self.json_path = _file_names(self.prefix)
        for path in (self.idx_path, self.bin_path, self.json_path):
            if not path.is_file():
                raise self._error(f"{path} not found; {_REBUILD_HINT}")
        self.dtype, num_documents, self.checksum = self._read_header()
        self.files = MappedFiles()  # checked before every batch: see mapped.py
        self.doc_offsets: np.ndarray = self.files.array(self.idx_path, "<i8", _HEADER.size, num_documents + 1)
        offsets = self.doc_offsets  # walked a chunk at a time, once a process (index_scan.py)
        if offsets[0] != 0 or not walked_once((self.idx_path,), "offsets in order", lambda: nondecreasing(offsets)):
            raise self._error(f"{self.idx_path} holds non-monotonic document offsets (corrupt); {_REBUILD_HINT}")
        expected_bytes = int(self.doc_offsets[-1]) * self.dtype.itemsize
        actual_bytes = self.bin_path.stat().st_size
        if actual_bytes != expected_bytes:
            raise self._error(
                f"{self.bin_path} holds {actual_bytes} bytes but {self.idx_path} expects {expected_bytes} "
                f"(truncated or from another build); {_REBUILD_HINT}"
            )
        self.tokens: np.ndarray = self.files.array(self.bin_path, self.dtype)
        self.metadata: dict[str, Any] = self._read_metadata()

    def _error(self, detail: str) -> DataError:
        return DataError(f"data.path={self.prefix}: {detail}")

    def _read_header(self) -> tuple[np.dtype, int, bytes]:
        header = read_head(self.idx_path, _HEADER.size)
        if len(header) < _HEADER.size:
            raise self._error(f"{self.idx_path} is truncated ({len(header)} bytes); {_REBUILD_HINT}")
        magic, version, dtype_code, num_documents, checksum = _HEADER.unpack(header)
        if magic != MAGIC:
            raise self._error(f"{self.idx_path} is not a megaframe index (bad magic bytes); {_REBUILD_HINT}")
        if version != FORMAT_VERSION:
            raise self._error(
                f"{self.idx_path} has format version {version}, expected {FORMAT_VERSION}; {_REBUILD_HINT}"
            )
        if dtype_code not in _DTYPE_BY_CODE:
            raise self._error(f"{self.idx_path} has unknown dtype code {dtype_code} (corrupt); {_REBUILD_HINT}")
        expected_size = _HEADER.size + 8 * (num_documents + 1)
        if self.idx_path.stat().st_size != expected_size:
            raise self._error(
                f"{self.idx_path} holds {self.idx_path.stat().st_size} bytes, expected {expected_size} "
                f"for {num_documents} documents (truncated or corrupt); {_REBUILD_HINT}"
            )
        return _DTYPE_BY_CODE[dtype_code], num_documents, checksum

    def _read_metadata(self) -> dict[str, Any]:
        try:
            metadata = json_text.loads(self.json_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._error(f"{self.json_path} is not valid JSON ({error}); {_REBUILD_HINT}") from None
        if not isinstance(metadata, dict):
            raise self._error(f"{self.json_path} must hold a JSON object; {_REBUILD_HINT}")
        missing = [key for key in _REQUIRED_METADATA if key not in metadata]
        if missing:
            raise self._error(f"{self.json_path} lacks {missing}; {_REBUILD_HINT}")
        if problem := field_problem(metadata, self.dtype):
            raise self._error(f"{self.json_path}: {problem} (damaged or edited); {_REBUILD_HINT}")
        # The checksum ties the .json to this exact .idx/.bin build, catching mixed-up copies.
        if metadata.get("checksum") != self.checksum.hex():
            raise self._error(f"{self.json_path} belongs to a different build than {self.idx_path}; {_REBUILD_HINT}")
        if metadata.get("num_documents") != len(self) or metadata.get("num_tokens") != self.num_tokens:
            raise self._error(f"{self.json_path} document/token counts disagree with {self.idx_path}; {_REBUILD_HINT}")
        return metadata

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents."""
        return int(self.doc_offsets[-1])

    @property
    def vocab_size(self) -> int:
        """Vocabulary size recorded by the tokenizer that built the dataset."""
        return int(self.metadata["vocab_size"])

    @property
    def eod_id(self) -> int:
        """End-of-document token id recorded at build time."""
        return int(self.metadata["eod_id"])

    @property
    def vocab_source(self) -> str:
        """Where the vocabulary came from, for error messages."""
        return f"the tokenizer's, recorded in {self.json_path}"

    def __len__(self) -> int:
        """Number of documents."""
        return len(self.doc_offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        """Tokens of document `index` (a read-only view into the map)."""
        num_documents = len(self)
        position = int(index)
        if position < 0:
            position += num_documents
        if not 0 <= position < num_documents:
            raise IndexError(f"document {index} out of range for {num_documents} documents in {self.prefix}")
        return self.tokens[self.doc_offsets[position] : self.doc_offsets[position + 1]]

    def check_files(self) -> None:
        """DataError when a file has shrunk since it was opened (mapped.py): read, it would kill the run."""
        if shrunk := self.files.shrunk():
            raise self._error(shrunk)

    def verify(self) -> None:
        """Re-hash the .bin and .idx against the build checksum; DataError if any byte changed."""
        if content_checksum(self.tokens, self.doc_offsets) != self.checksum:
            raise self._error(
                f"{self.bin_path} or {self.idx_path} content does not match its checksum (corrupt); {_REBUILD_HINT}"
            )

    def __reduce__(self) -> tuple[type[IndexedDataset], tuple[str]]:
        """Pickle by prefix so worker processes re-open the memmap instead of copying the tokens."""
        return IndexedDataset, (str(self.prefix),)

    def __repr__(self) -> str:
        """Short description with the prefix and sizes."""
        return f"IndexedDataset({str(self.prefix)!r}, documents={len(self)}, tokens={self.num_tokens})"
