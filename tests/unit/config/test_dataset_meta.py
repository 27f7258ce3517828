"""The sidecar's vocabulary read before launch (config/dataset_meta.py): read through safe_files,
capped, one line naming the file; a sidecar the user linked into place is still read."""
from __future__ import annotations

import json

import pytest

from megaframe.config import dataset_meta
from megaframe.config.dataset_meta import SidecarError, recorded_vocab_size


def test_a_sidecar_larger_than_one_is_refused_unread_and_a_linked_one_is_read(tmp_path, monkeypatch):
    sidecar = {"vocab_size": 257, "source_files": ["x" * 100]}
    (tmp_path / "data.json").write_text(json.dumps(sidecar))
    (tmp_path / "linked.json").symlink_to(tmp_path / "data.json")  # the user's own link: followed
    assert recorded_vocab_size(str(tmp_path / "data")) == 257
    assert recorded_vocab_size(str(tmp_path / "linked")) == 257
    monkeypatch.setattr(dataset_meta, "MAX_SIDECAR_BYTES", 64)
    with pytest.raises(SidecarError) as error:
        recorded_vocab_size(str(tmp_path / "data"))
    message = str(error.value)
    assert "\n" not in message and "data.json" in message and "more than the 64" in message
    assert "megaframe-preprocess" in message
