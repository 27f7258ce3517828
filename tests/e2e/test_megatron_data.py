"""A dataset written by Megatron-LM's own builder trains through megaframe-train as data.path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.helpers import TINY, assert_ok, read_metrics, run_cli

pytestmark = pytest.mark.slow


def test_megatron_dataset_trains_with_the_byte_tokenizer(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "megatron_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(400):  # documents of byte ids, each ended by the byte tokenizer's end-of-document id
        builder.add_item(torch.tensor([*rng.integers(0, 256, int(rng.integers(20, 200))), 256]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    result = run_cli([*TINY, f"data.path={prefix}", "data.tokenizer=byte", "train.max_steps=4",
                      f"hydra.run.dir={tmp_path / 'run'}"])
    assert_ok(result)
    assert "vocab=257" in result.stdout, result.stdout[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4]
