"""Turns DataConfig into the train / validation sample sets the trainer draws from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megaframe.config.schema import DataConfig
from megaframe.data import SampleSet, TokenStream, ensure_demo_dataset, open_dataset, split_documents
from megaframe.data.formats import Dataset
from megaframe.paths import cache_dir


@dataclass
class DataSplits:
    """Train and validation samples plus the vocabulary the dataset was tokenized with."""

    prefix: Path
    dataset: Dataset  # megaframe's format or Megatron's
    train: SampleSet
    valid: Optional[SampleSet]
    vocab_size: int


def dataset_prefix(cfg: DataConfig) -> Path:
    """data.path, or the demo corpus (built into the cache on first use)."""
    if cfg.path is not None:
        return Path(cfg.path)
    return ensure_demo_dataset(cache_dir(cfg.cache_dir))


def build_data(cfg: DataConfig, seq_length: int) -> DataSplits:
    """Open the dataset and split it by documents into train and validation samples."""
    prefix = dataset_prefix(cfg)
    dataset = open_dataset(prefix, cfg.tokenizer)
    train_range, valid_range = split_documents(len(dataset), cfg.valid_fraction)
    train = SampleSet(TokenStream(dataset, *train_range), seq_length)
    valid = SampleSet(TokenStream(dataset, *valid_range), seq_length) if cfg.valid_fraction > 0 else None
    return DataSplits(prefix=prefix, dataset=dataset, train=train, valid=valid, vocab_size=dataset.vocab_size)
