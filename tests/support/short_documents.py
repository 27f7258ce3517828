"""A corpus of short documents for the document-mask tests: every training sample of TINY's 32 tokens
holds several end-of-document tokens (the demo corpus's documents are longer than a sample: its first
steps hold none, so a document mask would change nothing there)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

EOD = 256  # the byte tokenizer's end-of-document id


def write_short_documents(prefix: Path, count: int = 2000, seed: int = 0) -> str:
    """`count` documents of 3 to 20 byte tokens, each ending in EOD, written with megaframe's writer;
    returns the prefix for data.path."""
    from megaframe.data import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix) as writer:
        for length in rng.integers(3, 21, size=count):
            writer.add_document([*rng.integers(0, EOD, size=length - 1), EOD])
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": EOD})
    return str(prefix)
