"""Tokenizers for building datasets: a dependency-free byte tokenizer and local Hugging Face tokenizers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

from megaframe.common.tokenizer_files import identity
from megaframe.data.indexed import DataError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "build_tokenizer", "sidecar_record"]


@runtime_checkable
class Tokenizer(Protocol):
    """What dataset building needs from a tokenizer."""

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, dropping the end-of-document token."""


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus end-of-document token 256."""

    name = "byte"
    vocab_size = 257
    eod_id = 256
    bos_id = None

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD and end-of-document tokens are skipped."""
        byte_values = [int(token) for token in ids if int(token) != self.eod_id]
        invalid = [value for value in byte_values if not 0 <= value < 256]
        if invalid:
            raise DataError(
                f"ByteTokenizer.decode: ids must be in 0..256, got {invalid[0]}; decode with the dataset's tokenizer"
            )
        return bytes(byte_values).decode("utf-8", errors="replace")


class TokenizerDoesNotLoad(DataError):
    """The directory's tokenizer does not load here (without running its own code, or for want of a
    package or of its vocabulary files); one that loads without an eos token is a plain DataError."""


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloads)."""

    def __init__(self, path: str | os.PathLike[str], named: str = "data.tokenizer=") -> None:
        """Load the tokenizer saved (save_pretrained) in directory `path`; `named`: how errors name it
        (the config key, or megaframe-preprocess's "--tokenizer ")."""
        # Imported here so byte-level runs never pay for importing transformers.
        from transformers import AutoTokenizer

        self.name = str(path)
        try:
            # never the directory's own Python (an auto_map): transformers would ask on the terminal to run it
            self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as error:  # transformers raises OSError, ValueError, KeyError... depending on what is missing
            reason = " ".join(str(error).split())[:300]
            raise TokenizerDoesNotLoad(
                f"{named}{path}: cannot load a tokenizer from this directory "
                f"({type(error).__name__}: {reason}); "
                "point it at a directory written by save_pretrained()"
            ) from None
        if self._tokenizer.eos_token_id is None:
            raise DataError(
                f"{named}{path}: tokenizer has no eos_token to mark document ends; "
                "set eos_token in its tokenizer_config.json"
            )
        if len(self._tokenizer) <= len(set(self._tokenizer.all_special_ids)):
            # a tokenizer_config.json without its vocabulary files loads as a tokenizer of its special
            # tokens alone, which encodes every text to nothing
            raise DataError(
                f"{named}{path}: the tokenizer has no tokens beyond its {len(self._tokenizer)} special "
                "ones (its vocabulary files are missing); point it at a directory written by save_pretrained()"
            )
        self.vocab_size = len(self._tokenizer)
        self.eod_id = int(self._tokenizer.eos_token_id)
        bos = self._tokenizer.bos_token_id
        self.bos_id = int(bos) if bos is not None else None  # recorded with checkpoints, set in HF exports

    def vocabulary(self) -> dict[str, int]:
        """Every token's id, added tokens included (two tokenizers mapping alike map these alike)."""
        return dict(self._tokenizer.get_vocab())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without BOS/EOS or other special tokens."""
        # verbose=False: documents are routinely longer than model_max_length, which is fine here.
        return list(self._tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, dropping the end-of-document token."""
        return self._tokenizer.decode([int(token) for token in ids if int(token) != self.eod_id])


def sidecar_record(tokenizer: Tokenizer) -> dict:
    """What a dataset's sidecar records of the tokenizer that made its tokens: its name, vocabulary and
    end-of-document id, and for a Hugging Face one the sha256 of its files (another tokenizer with the
    same vocabulary size and end-of-document id maps the ids to other text; data/formats.py compares)."""
    record = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id}
    if isinstance(tokenizer, HFTokenizer):
        try:  # its full path: a run started from another folder is told where it is (--tokenizer tok was "tok")
            record["tokenizer"], record["tokenizer_sha256"], record["tokenizer_hash_scheme"] = identity(tokenizer.name)
        except OSError as err:
            raise DataError(f"--tokenizer {tokenizer.name}: cannot read its files to record their hash "
                            f"({err.strerror or err})") from None
    return record


def build_tokenizer(spec: str | os.PathLike[str], named: str = "data.tokenizer=") -> ByteTokenizer | HFTokenizer:
    """'byte' -> ByteTokenizer; an existing local directory -> HFTokenizer; anything else -> DataError."""
    if str(spec) == "byte":
        return ByteTokenizer()
    if Path(spec).is_dir():
        return HFTokenizer(spec, named)
    raise DataError(
        f"{named}{spec}: not 'byte' and not a local directory; use 'byte' or the path of a "
        "directory saved with save_pretrained() (nothing is downloaded)"
    )
