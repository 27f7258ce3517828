"""write_streaming writes ordinary safetensors files, one tensor at a time, and hashes what it wrote."""
from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from megaframe.checkpoint.stream import write_streaming


def test_streamed_file_reads_back_with_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4, 2).to(torch.bfloat16), "d": torch.randn(1)}
    made = []

    def produce(name):
        made.append(name)
        return tensors[name]

    path = tmp_path / "x.safetensors"
    size, sha = write_streaming(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], produce)
    assert made == list(tensors)  # each tensor made once, in header order
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)
    data = path.read_bytes()
    assert size == len(data) and sha == hashlib.sha256(data).hexdigest()
    assert not list(tmp_path.glob(".*tmp"))


def test_a_tensor_that_disagrees_with_the_header_leaves_no_file(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="header says"):
        write_streaming(path, [("a", torch.float32, (2, 2))], lambda name: torch.zeros(3))
    assert not path.exists() and not list(tmp_path.iterdir())
