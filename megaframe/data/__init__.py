"""Data pipeline: indexed token datasets, tokenizers, layout-invariant sampling, demo corpus, preprocessing."""

from megaframe.data.dataset import (
    SampleSet,
    TokenStream,
    eval_batches,
    global_batch_indices,
    micro_batches,
    split_documents,
)
from megaframe.data.demo import ensure_demo_dataset
from megaframe.data.formats import open_dataset
from megaframe.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, best_dtype
from megaframe.data.preprocess import preprocess
from megaframe.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "SampleSet",
    "TokenStream",
    "Tokenizer",
    "best_dtype",
    "build_tokenizer",
    "ensure_demo_dataset",
    "eval_batches",
    "global_batch_indices",
    "micro_batches",
    "open_dataset",
    "preprocess",
    "split_documents",
]
