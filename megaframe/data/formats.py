"""data.path=PREFIX in either on-disk layout, told apart by the index's magic bytes: Megatron-LM's
(MMIDIDX; what megaframe writes by default, with a JSON sidecar naming the tokenizer; without one, as
Megatron writes it, the vocabulary and end-of-document id come from data.tokenizer) or megaframe's
earlier MFTOKIDX (its sidecar names the tokenizer)."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional, Union

from megaframe.common.tokenizer_files import files_hash, tokenizer_files
from megaframe.data.indexed import MAGIC as OWN_MAGIC
from megaframe.data.indexed import DataError, IndexedDataset
from megaframe.data.token_files import read_head
from megaframe.data.megatron import MAGIC as MEGATRON_MAGIC
from megaframe.data.megatron import MegatronDataset, read_sidecar

Dataset = Union[IndexedDataset, MegatronDataset]


class TokenizerMismatch(DataError):
    """A dataset whose sidecar records another tokenizer than data.tokenizer (and another vocabulary
    or end-of-document id): `recorded` made its tokens; megaframe-eval says it in its own words."""

    def __init__(self, message: str, prefix: str, recorded: str):
        super().__init__(message)
        self.prefix, self.recorded = prefix, recorded


def open_dataset(prefix: Union[str, os.PathLike[str]], tokenizer: Optional[str] = None) -> Dataset:
    """The dataset at PREFIX.bin/.idx; `tokenizer` (data.tokenizer) supplies the vocabulary of a
    Megatron file that has no megaframe sidecar (without one either, DataError says to set it)."""
    idx = Path(f"{prefix}.idx")
    head = read_head(idx, len(MEGATRON_MAGIC))
    if not head.startswith(MEGATRON_MAGIC):
        if len(head) >= len(OWN_MAGIC) and not head.startswith(OWN_MAGIC):
            raise DataError(f"data.path={prefix}: {idx} is neither a megaframe (MFTOKIDX) nor a Megatron (MMIDIDX) "
                            f"index (bad magic bytes); rebuild it with megaframe-preprocess")
        return _check_tokenizer(IndexedDataset(prefix), prefix, tokenizer)
    if tokenizer is None or read_sidecar(prefix) is not None:
        return _check_tokenizer(MegatronDataset(prefix), prefix, tokenizer)
    from megaframe.data.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(tokenizer)
    except (OSError, ValueError) as err:
        raise DataError(f"data.tokenizer={tokenizer}: cannot load it for the Megatron dataset {prefix} ({err}); "
                        f"pass byte or a local Hugging Face tokenizer directory") from None
    return MegatronDataset(prefix, tok.vocab_size, tok.eod_id, vocab_source=f"data.tokenizer={tokenizer}'s")


def _check_tokenizer(dataset: Dataset, prefix, tokenizer: Optional[str]) -> Dataset:
    """data.tokenizer must be the tokenizer the dataset's sidecar records: its files, where the sidecar
    holds their hash (a moved copy passes, a tokenizer replaced in place does not); else one of the same
    name, or with its vocabulary and end-of-document id. Training would not notice another, but every
    checkpoint records data.tokenizer and megaframe-convert to-hf ships it with the model."""
    recorded = dataset.metadata.get("tokenizer") if tokenizer is not None else None
    if recorded is None:
        return dataset
    digest = dataset.metadata.get("tokenizer_sha256")
    if digest is not None and str(tokenizer) != "byte" and Path(tokenizer).is_dir():
        return _check_files(dataset, prefix, str(tokenizer), str(recorded))
    if str(recorded) == str(tokenizer):
        return dataset
    if Path(str(recorded)).is_dir() and Path(tokenizer).is_dir() and \
            Path(str(recorded)).resolve() == Path(tokenizer).resolve():
        return dataset
    from megaframe.data.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(tokenizer)
        same = (tok.vocab_size, tok.eod_id) == (dataset.vocab_size, dataset.eod_id)
    except (DataError, OSError, ValueError):
        same = False
    if not same:
        raise TokenizerMismatch(f"data.tokenizer={tokenizer}, but {prefix}.json records that the dataset's tokens were "
                                f"made by {recorded} (vocabulary {dataset.vocab_size}): checkpoints and Hugging Face "
                                f"exports would name the wrong tokenizer; set data.tokenizer={recorded}",
                                str(prefix), str(recorded))
    return dataset


def _check_files(dataset: Dataset, prefix, tokenizer: str, recorded: str) -> Dataset:
    """data.tokenizer's files hash to what the sidecar records of the files that made the tokens."""
    try:
        same = _files_hash(str(Path(tokenizer).resolve()), dataset.metadata["tokenizer_hash_scheme"]) \
            == dataset.metadata["tokenizer_sha256"]
    except OSError as err:
        raise DataError(f"data.tokenizer={tokenizer}: cannot read its files to compare them with those that made "
                        f"{prefix}'s tokens ({err.strerror or err})") from None
    if same:
        return dataset
    if Path(recorded).resolve() == Path(tokenizer).resolve():
        raise TokenizerMismatch(f"data.tokenizer={tokenizer}: its files changed since they made {prefix}'s tokens "
                                f"({prefix}.json records their sha256): the ids would mean other text; put the "
                                f"tokenizer that made them back, or rebuild the dataset with megaframe-preprocess",
                                str(prefix), recorded)
    raise TokenizerMismatch(f"data.tokenizer={tokenizer} is not the tokenizer that made {prefix}'s tokens: its files "
                            f"differ from those {prefix}.json records ({recorded}), so the ids would mean other text "
                            f"(even with the same vocabulary {dataset.vocab_size}); set data.tokenizer={recorded}",
                            str(prefix), recorded)


def _files_hash(directory: str, scheme: int) -> str:
    """files_hash once per process and state of the files: each dataset of a blend names the same
    tokenizer (a file rewritten since has another size or time, and is hashed again)."""
    stamps = tuple((path.name, stat.st_size, stat.st_mtime_ns)
                   for path, stat in ((path, path.stat()) for path in tokenizer_files(Path(directory))))
    return _hash_of(directory, scheme, stamps)


@functools.lru_cache(maxsize=8)
def _hash_of(directory: str, scheme: int, stamps: tuple) -> str:
    return files_hash(Path(directory), scheme)
