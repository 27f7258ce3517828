"""megaframe/training/data_setup.py: the run's data, built from data.* keys."""
from __future__ import annotations

import numpy as np
import pytest

from megaframe.config.schema import DataConfig
from megaframe.data import DataError, IndexedDatasetWriter
from megaframe.data.megatron import write_index
from megaframe.training.data_setup import build_data


def _dataset(prefix, documents: int) -> str:
    if documents == 0:  # Megatron's builder writes such a pair; megaframe's writer refuses to
        with open(f"{prefix}.idx", "wb") as index:
            write_index(index, np.dtype(np.uint16), np.zeros(1, dtype=np.int64))
        open(f"{prefix}.bin", "wb").close()
        return str(prefix)
    with IndexedDatasetWriter(prefix) as writer:
        for _ in range(documents):
            writer.add_document(np.arange(300) % 256)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    return str(prefix)


@pytest.mark.parametrize("key", ["path", "blend"])
def test_a_dataset_of_no_documents_is_named(tmp_path, key):
    """It was `split_documents: num_documents=0; the dataset is empty`, naming no file of a blend's."""
    full, empty = _dataset(tmp_path / "full", 20), _dataset(tmp_path / "empty", 0)
    cfg = DataConfig(path=empty, tokenizer="byte", cache_dir=str(tmp_path / "cache")) if key == "path" else \
        DataConfig(blend=[1, full, 1, empty], tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=f"^{empty}: the dataset holds no documents; rebuild it from more text"):
        build_data(cfg, 32)
