"""A dataset's files changed in place while a run reads them: a DataError naming the file, where a
read past the new end of a memory map killed the run with SIGBUS (exit 135, no line)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from megaframe.data import DataError, IndexedDatasetWriter, SampleSet, TokenStream, open_dataset
from megaframe.data.blend import BlendedSamples, Stage

SEQ = 8


def sample_set(prefix: Path, layout: str = "megatron", documents: int = 40) -> SampleSet:
    with IndexedDatasetWriter(prefix, layout=layout) as writer:
        for document in range(documents):
            writer.add_document(np.arange(document, document + 33) % 256)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    dataset = open_dataset(prefix)
    return SampleSet(TokenStream(dataset, 0, len(dataset)), SEQ)


LAST_SAMPLES = np.arange(150, 160)  # read from the end of the .bin, past any truncation below


@pytest.mark.parametrize("layout", ["megatron", "megaframe"])
@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_file_truncated_under_the_run_is_a_data_error_naming_it(tmp_path, layout, suffix):
    samples = sample_set(tmp_path / "corpus", layout)
    before = samples.batch(LAST_SAMPLES)
    path = tmp_path / f"corpus{suffix}"
    size = path.stat().st_size
    os.truncate(path, size // 3)
    with pytest.raises(DataError) as caught:
        samples.batch(LAST_SAMPLES)
    message = str(caught.value)
    assert f"data.path={tmp_path / 'corpus'}" in message and f"{path} now holds {size // 3} bytes, {size}" in message
    assert "put back the files" in message and "\n" not in message
    with open(path, "r+b") as handle:  # grown back to its size: read as before
        handle.truncate(size)
    assert samples.batch(LAST_SAMPLES)[0].shape == before[0].shape


def test_a_file_replaced_by_a_rename_is_no_change_the_run_reads_what_it_opened(tmp_path):
    samples = sample_set(tmp_path / "corpus")
    before = samples.batch(LAST_SAMPLES)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * 10)  # megaframe-preprocess publishes by rename: the map keeps the old file
    os.replace(other, tmp_path / "corpus.bin")
    after = samples.batch(LAST_SAMPLES)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_a_blend_names_the_source_that_shrank(tmp_path):
    sources = [sample_set(tmp_path / "a"), sample_set(tmp_path / "b")]
    blend = BlendedSamples(sources, [Stage(0, (0.5, 0.5))], ["a", "b"])
    picks = np.array([[0, 150], [1, 155]])
    blend.batch(picks)
    os.truncate(tmp_path / "b.bin", 0)
    with pytest.raises(DataError, match=f"data.path={tmp_path / 'b'}: {tmp_path / 'b.bin'} now holds 0 bytes"):
        blend.batch(picks)
    blend.batch(picks[:1])  # a batch from the other source alone reads on


def test_a_dataset_of_empty_documents_maps_no_file_and_checks_clean(tmp_path):
    with IndexedDatasetWriter(tmp_path / "empty") as writer:
        writer.add_document([])
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    dataset = open_dataset(tmp_path / "empty")
    assert dataset.num_tokens == 0 and len(dataset[0]) == 0
    dataset.check_files()


@pytest.mark.parametrize("blended", [False, True])
def test_a_steps_micro_batches_stat_the_files_once(tmp_path, monkeypatch, blended):
    """Every micro-batch stat'ed its dataset's files (128 fstat calls a rank and step at a global batch
    of 1536 over dp=24, each possibly a round trip to Lustre's storage servers); the micro-batches of a
    step are read back to back, so one look before them guards them all, as one does an evaluation's."""
    from megaframe.data import eval_batches, micro_batches
    from megaframe.data.mapped import MappedFiles

    looks = []
    original = MappedFiles.shrunk
    monkeypatch.setattr(MappedFiles, "shrunk", lambda self: looks.append(self) or original(self))
    sources = [sample_set(tmp_path / "a"), sample_set(tmp_path / "b")]
    samples = BlendedSamples(sources, [Stage(0, (0.5, 0.5))], ["a", "b"]) if blended else sources[0]
    batches = micro_batches(samples, 0, 16, 2, 0, 1, 0)
    assert len(batches) == 8 and len(looks) == len(sources if blended else sources[:1])
    looks.clear()
    assert len(eval_batches(samples, 4, 2, 0, 1)) == 4 and len(looks) == len(sources if blended else sources[:1])
    os.truncate(tmp_path / "a.bin", 0)
    with pytest.raises(DataError, match="now holds 0 bytes"):
        micro_batches(samples, 1, 16, 2, 0, 1, 0)


def test_a_step_stats_only_the_sources_it_samples(tmp_path, monkeypatch):
    """A blend that lists each shard as a source stats the files of the shards a step reads, not of
    every source (200 sources: 200 looks a step for the 33 a step read); a source with weight 0 that
    shrank does not stop the run."""
    from megaframe.data import micro_batches
    from megaframe.data.mapped import MappedFiles

    looks = []
    original = MappedFiles.shrunk
    monkeypatch.setattr(MappedFiles, "shrunk", lambda self: looks.append(self) or original(self))
    sources = [sample_set(tmp_path / "a"), sample_set(tmp_path / "b")]
    blend = BlendedSamples(sources, [Stage(0, (1.0, 0.0))], ["a", "b"])
    os.truncate(tmp_path / "b.bin", 0)
    assert len(micro_batches(blend, 0, 16, 2, 0, 1, 0)) == 8 and len(looks) == 1
