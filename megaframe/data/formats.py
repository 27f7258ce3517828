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
from megaframe.data.index_scan import file_identity
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
    """data.tokenizer against what the sidecar records of the tokenizer that made the tokens: its files'
    hash, vocabulary size and end-of-document id (the hash covers the vocabulary files, not the eos
    token of tokenizer_config.json). Files that hash otherwise pass when they map every token to the
    same id as the recorded tokenizer, still in place and unchanged: a copy re-saved by another
    version of `tokenizers` writes other bytes for the same mapping."""
    digest, scheme = dataset.metadata["tokenizer_sha256"], dataset.metadata["tokenizer_hash_scheme"]
    same_files = _files_hash(tokenizer, scheme, prefix) == digest
    loaded = _loaded(tokenizer)
    ids = (loaded.vocab_size, loaded.eod_id)
    if ids != (dataset.vocab_size, dataset.eod_id):
        raise TokenizerMismatch(f"data.tokenizer={tokenizer} has vocabulary {ids[0]} and end-of-document id {ids[1]}, "
                                f"but {prefix}'s tokens were made with {dataset.vocab_size} and {dataset.eod_id} "
                                f"({prefix}.json): set data.tokenizer={recorded}, or rebuild the dataset with "
                                f"megaframe-preprocess --tokenizer {tokenizer}", str(prefix), recorded)
    if same_files or _same_mapping(loaded, recorded, digest, scheme, prefix):
        return dataset
    if Path(recorded).resolve() == Path(tokenizer).resolve():
        raise TokenizerMismatch(f"data.tokenizer={tokenizer}: its files changed since they made {prefix}'s tokens "
                                f"({prefix}.json records their sha256): the ids would mean other text; put the "
                                f"tokenizer that made them back, or rebuild the dataset with megaframe-preprocess",
                                str(prefix), recorded)
    raise TokenizerMismatch(f"data.tokenizer={tokenizer} is not the tokenizer that made {prefix}'s tokens: its files "
                            f"differ from those {prefix}.json records ({recorded}) and map tokens to other ids, so the "
                            f"ids would mean other text; set data.tokenizer={recorded}", str(prefix), recorded)


def _same_mapping(loaded, recorded: str, digest: str, scheme: int, prefix) -> bool:
    """Whether the recorded tokenizer is still in place, unchanged, and maps every token to the id
    `loaded` does (and has its special ids)."""
    if not Path(recorded).is_dir():
        return False
    try:
        if _files_hash(recorded, scheme, prefix) != digest:
            return False
        other = _loaded(recorded)
    except DataError:
        return False
    return (other.eod_id, other.bos_id) == (loaded.eod_id, loaded.bos_id) and other.vocabulary() == loaded.vocabulary()


def _stamps(directory: str) -> tuple:
    """The tokenizer files of `directory` as they are now (index_scan.file_identity)."""
    return tuple(file_identity(path) for path in tokenizer_files(Path(directory)))


def _files_hash(directory: str, scheme: int, prefix) -> str:
    """files_hash once per process and state of the files: each dataset of a blend names the same
    tokenizer. DataError (one line) when they cannot be read."""
    resolved = str(Path(directory).resolve())
    try:
        return _hash_of(resolved, scheme, _stamps(resolved))
    except OSError as err:
        raise DataError(f"data.tokenizer={directory}: cannot read its files to compare them with those that made "
                        f"{prefix}'s tokens ({err.strerror or err}); make them readable to this user, or point "
                        f"data.tokenizer at a readable copy") from None


@functools.lru_cache(maxsize=8)
def _hash_of(directory: str, scheme: int, stamps: tuple) -> str:
    return files_hash(Path(directory), scheme)


def _loaded(directory: str):
    """The tokenizer in `directory`, loaded once per process and state of its files."""
    resolved = str(Path(directory).resolve())
    return _load(resolved, _stamps(resolved))


@functools.lru_cache(maxsize=4)
def _load(directory: str, stamps: tuple):
    from megaframe.data.tokenizer import build_tokenizer

    return build_tokenizer(directory)
