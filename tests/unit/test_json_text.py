"""megaframe/common/json_text.py: JSON nested deeper than the interpreter's stack is malformed JSON, which
every reader of a user's or a crash's file reports in its one line, not a RecursionError traceback."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megaframe.common import json_text

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text", [DEEP, DEEP.encode(), '{"a": ' * 50_000 + "1" + "}" * 50_000])
def test_nesting_deeper_than_the_stack_is_a_json_decode_error(text):
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        json_text.loads(text)
    assert json_text.loads('{"a": [[1]]}') == {"a": [[1]]}


def test_a_dataset_sidecar_nested_too_deeply_is_a_data_error_naming_it(tmp_path):
    from megaframe.config.dataset_meta import SidecarError, recorded_vocab_size
    from megaframe.data import DataError, IndexedDatasetWriter, open_dataset

    for layout in ("megatron", "megaframe"):
        prefix = tmp_path / layout
        with IndexedDatasetWriter(prefix, layout=layout) as writer:
            writer.add_document(np.arange(40))
            writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
        (tmp_path / f"{layout}.json").write_text(DEEP)
        with pytest.raises(DataError, match=f"{prefix}.json is not valid JSON"):
            open_dataset(prefix)
        with pytest.raises(SidecarError, match=f"{prefix}.json is not valid JSON \\(nested too deeply at byte 0\\)"):
            recorded_vocab_size(str(prefix))  # what megaframe-train and -plan read before launch


def test_a_jsonl_line_nested_too_deeply_names_the_line(tmp_path):
    from megaframe.data import DataError
    from megaframe.data.sources import find_sources, iter_documents

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n' + DEEP + "\n")
    [source] = find_sources([str(corpus)])
    with pytest.raises(DataError, match=r"corpus.jsonl:2: invalid JSON \(nested too deeply\)"):
        list(iter_documents(source))
