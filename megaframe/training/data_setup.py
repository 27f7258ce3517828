"""Turns DataConfig into the train / validation samples the trainer draws from: one dataset
(data.path, or the demo corpus), or a weighted blend of several (data.blend)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from megaframe.config.schema import DataConfig
from megaframe.data import DataError, SampleSet, TokenStream, ensure_demo_dataset, open_dataset, split_documents
from megaframe.data.blend import BlendedSamples, Stage, parse_blend
from megaframe.data.epoch_orders import EpochOrders
from megaframe.data.formats import Dataset
from megaframe.common.paths import cache_dir

Samples = Union[SampleSet, BlendedSamples]


@dataclass
class DataSplits:
    """Train and validation samples, the datasets they come from and their common vocabulary."""

    datasets: list[Dataset]  # megaframe's format or Megatron's; several under data.blend
    train: Samples
    valid: Optional[Samples]
    vocab_size: int

    @property
    def blended(self) -> bool:
        return isinstance(self.train, BlendedSamples)


def dataset_prefix(cfg: DataConfig) -> Path:
    """data.path, or the demo corpus (built into the cache on first use)."""
    if cfg.path is not None:
        return Path(cfg.path)
    return ensure_demo_dataset(cache_dir(cfg.cache_dir))


def _split(dataset: Dataset, valid_fraction: float, seq_length: int,
           orders: Optional[EpochOrders] = None) -> tuple[SampleSet, Optional[SampleSet]]:
    if len(dataset) == 0:  # split_documents would say so without naming the dataset
        raise DataError(f"{dataset.prefix}: the dataset holds no documents; rebuild it from more text or leave it out")
    train_range, valid_range = split_documents(len(dataset), valid_fraction)
    train = SampleSet(TokenStream(dataset, *train_range), seq_length, orders)
    valid = SampleSet(TokenStream(dataset, *valid_range), seq_length) if valid_fraction > 0 else None
    return train, valid


def _whole(dataset: Dataset, seq_length: int, orders: Optional[EpochOrders] = None) -> SampleSet:
    return SampleSet(TokenStream(dataset, 0, len(dataset)), seq_length, orders)


def source_names(prefixes: list[str]) -> list[str]:
    """Metric labels of blend sources: each prefix's file name, numbered where two are the same."""
    names = [Path(prefix).name for prefix in prefixes]
    return [f"{name}.{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def blend_stages(cfg: DataConfig, weights: list[float]) -> list[Stage]:
    """data.blend's weights from step 0, then data.blend_schedule's [[step, [w1, w2, ...]], ...]."""
    return [Stage.of(0, weights)] + [Stage.of(step, stage_weights) for step, stage_weights in cfg.blend_schedule or []]


def _open_all(prefixes: list[str], tokenizer: str, key: str) -> list[Dataset]:
    datasets = [open_dataset(prefix, tokenizer) for prefix in prefixes]
    vocabularies = {(d.vocab_size, d.eod_id) for d in datasets}
    if len(vocabularies) > 1:
        described = ", ".join(f"{p}: {d.vocab_size}/{d.eod_id}" for p, d in zip(prefixes, datasets))
        raise DataError(f"{key}: the sources were built with different tokenizers (vocabulary/end-of-document "
                        f"{described}); rebuild them with one tokenizer")
    return datasets


def build_blend(cfg: DataConfig, seq_length: int) -> DataSplits:
    """data.blend: each source split by data.valid_fraction (validation is the blend of the held-out
    parts, with data.blend's weights), or used whole when data.valid_blend names the validation sources."""
    weights, prefixes = parse_blend(cfg.blend)
    datasets = _open_all(prefixes, cfg.tokenizer, "data.blend")
    names = source_names(prefixes)
    if cfg.valid_blend:
        train_sets = [_whole(dataset, seq_length) for dataset in datasets]
        valid_weights, valid_prefixes = parse_blend(cfg.valid_blend, "data.valid_blend")
        valid_datasets = _open_all(valid_prefixes, cfg.tokenizer, "data.valid_blend")
        if valid_datasets[0].vocab_size != datasets[0].vocab_size:
            raise DataError("data.valid_blend: its sources were built with another tokenizer than data.blend's")
        valid = BlendedSamples([_whole(d, seq_length) for d in valid_datasets], [Stage.of(0, valid_weights)],
                               source_names(valid_prefixes), shuffle=False)
    else:
        splits = [_split(dataset, cfg.valid_fraction, seq_length) for dataset in datasets]
        train_sets = [train for train, _ in splits]
        valid = BlendedSamples([v for _, v in splits], [Stage.of(0, weights)], names, shuffle=False) \
            if cfg.valid_fraction > 0 else None
    train = BlendedSamples(train_sets, blend_stages(cfg, weights), names, orders=_orders(cfg))
    return DataSplits(datasets=datasets + (valid_datasets if cfg.valid_blend else []), train=train, valid=valid,
                      vocab_size=datasets[0].vocab_size)


def _orders(cfg: DataConfig) -> EpochOrders:
    """The training set's epoch orders: shared by the host's ranks through data.cache_dir once large."""
    try:
        return EpochOrders(cache_dir(cfg.cache_dir) / "orders")
    except (RuntimeError, KeyError):  # no home directory (a container's user without one): in memory
        return EpochOrders(None)


def build_eval_data(cfg: DataConfig, seq_length: int) -> DataSplits:
    """build_data for scoring its validation set alone (megaframe-eval): a validation file of its own
    is opened alone, so the training data need not be there nor match it; else build_data."""
    if cfg.blend or cfg.valid_path is None:
        return build_data(cfg, seq_length)
    held_out = open_dataset(cfg.valid_path, cfg.tokenizer)
    valid = _whole(held_out, seq_length)
    return DataSplits(datasets=[held_out], train=valid, valid=valid, vocab_size=held_out.vocab_size)


def build_data(cfg: DataConfig, seq_length: int) -> DataSplits:
    """Open the dataset(s) and split them by documents into train and validation samples."""
    if cfg.blend:
        return build_blend(cfg, seq_length)
    dataset = open_dataset(dataset_prefix(cfg), cfg.tokenizer)
    if cfg.valid_path is None:
        train, valid = _split(dataset, cfg.valid_fraction, seq_length, _orders(cfg))
        return DataSplits(datasets=[dataset], train=train, valid=valid, vocab_size=dataset.vocab_size)
    # a validation file of its own: both train whole (data.valid_fraction does not apply)
    held_out = open_dataset(cfg.valid_path, cfg.tokenizer)
    if (held_out.vocab_size, held_out.eod_id) != (dataset.vocab_size, dataset.eod_id):
        raise DataError(f"data.valid_path={cfg.valid_path}: built with another tokenizer than data.path's (vocabulary "
                        f"{held_out.vocab_size} against {dataset.vocab_size}); preprocess both with one tokenizer")
    return DataSplits(datasets=[dataset, held_out], train=_whole(dataset, seq_length, _orders(cfg)),
                      valid=_whole(held_out, seq_length), vocab_size=dataset.vocab_size)
