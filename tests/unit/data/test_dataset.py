"""Tests for layout-invariant sampling: splits, windows, global batches, dp slicing, eval batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megaframe.data import (
    DataError,
    open_dataset,
    IndexedDatasetWriter,
    SampleSet,
    TokenStream,
    eval_batches,
    global_batch_indices,
    micro_batches,
    split_documents,
)
from megaframe.data import dataset as dataset_module
from megaframe.data.formats import Dataset

BYTE_METADATA = {"tokenizer": "byte", "vocab_size": 257, "eod_id": 256}


def build(prefix: Path, documents: list[list[int]]) -> Dataset:
    """Write and open a byte-vocabulary dataset holding `documents`."""
    with IndexedDatasetWriter(prefix) as writer:
        for document in documents:
            writer.add_document(document)
        writer.finalize(BYTE_METADATA)
    return open_dataset(prefix)


@pytest.fixture
def corpus(tmp_path: Path) -> Dataset:
    """Twenty documents of varying length with distinct-ish token values."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 256, size=int(rng.integers(5, 60))).tolist() + [256] for _ in range(20)]
    return build(tmp_path / "corpus", documents)


def reference_indices(step: int, global_batch_size: int, num_samples: int, seed: int) -> np.ndarray:
    """Materialise every epoch up to the step: the slow, obviously-correct definition."""
    end = (step + 1) * global_batch_size
    epochs = [np.random.default_rng([seed, epoch]).permutation(num_samples) for epoch in range(end // num_samples + 1)]
    return np.concatenate(epochs)[step * global_batch_size : end]


def test_token_stream_covers_documents(corpus: Dataset) -> None:
    stream = TokenStream(corpus, 3, 7)
    expected = np.concatenate([corpus[index] for index in range(3, 7)])
    assert np.array_equal(stream.tokens, expected)
    assert len(stream) == len(expected)
    assert len(TokenStream(corpus, 5, 5)) == 0
    with pytest.raises(DataError):
        TokenStream(corpus, 0, len(corpus) + 1)


def test_sample_windows_overlap_by_one_token(corpus: Dataset) -> None:
    stream = TokenStream(corpus, 0, len(corpus))
    seq_length = 16
    samples = SampleSet(stream, seq_length)
    assert len(samples) == (corpus.num_tokens - 1) // seq_length
    for index in (0, 1, len(samples) - 1):
        start = index * seq_length
        assert np.array_equal(samples[index], corpus.tokens[start : start + seq_length + 1])
    inputs, targets = samples.batch([2, 0])
    assert inputs.dtype == torch.int64 and targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (2, seq_length)
    assert torch.equal(inputs[0], torch.from_numpy(samples[2][:-1].astype(np.int64)))
    assert torch.equal(targets[1], torch.from_numpy(samples[0][1:].astype(np.int64)))
    with pytest.raises(IndexError):
        samples[len(samples)]


def test_too_few_tokens_is_a_data_error(tmp_path: Path) -> None:
    tiny = build(tmp_path / "tiny", [[1, 2, 3, 256]])
    with pytest.raises(DataError) as error:
        SampleSet(TokenStream(tiny, 0, 1), seq_length=4)
    message = str(error.value)
    assert "only 4 tokens" in message and "model.seq_length+1=5" in message and "\n" not in message
    assert len(SampleSet(TokenStream(tiny, 0, 1), seq_length=3)) == 1


@pytest.mark.parametrize(
    "num_documents, valid_fraction, expected",
    [
        (10, 0.1, ((0, 9), (9, 10))),
        (100, 0.07, ((0, 93), (93, 100))),  # 0.07 * 100 is 7.000000000000001 in floating point
        (10, 0.15, ((0, 8), (8, 10))),
        (2, 0.01, ((0, 1), (1, 2))),
        (5, 0.99, ((0, 1), (1, 5))),
        (10, 0.0, ((0, 10), (10, 10))),
        (1, 0.0, ((0, 1), (1, 1))),
        (1, 0.25, ((0, 0.75), (0.75, 1))),
    ],
)
def test_split_documents(num_documents: int, valid_fraction: float, expected) -> None:
    assert split_documents(num_documents, valid_fraction) == expected


@pytest.mark.parametrize("num_documents, valid_fraction", [(0, 0.1), (10, 1.0), (10, -0.1)])
def test_split_documents_rejects_bad_arguments(num_documents: int, valid_fraction: float) -> None:
    with pytest.raises(DataError):
        split_documents(num_documents, valid_fraction)


def test_single_document_split_divides_its_tokens(tmp_path: Path) -> None:
    single = build(tmp_path / "single", [list(range(200)) + [256]])
    train_range, valid_range = split_documents(len(single), 0.2)
    train, valid = TokenStream(single, *train_range), TokenStream(single, *valid_range)
    assert (train.token_start, train.token_end, valid.token_start, valid.token_end) == (0, 160, 160, 201)
    assert np.array_equal(np.concatenate([train.tokens, valid.tokens]), single.tokens)
    assert len(SampleSet(train, 8)) == 19 and len(SampleSet(valid, 8)) == 5


def test_multi_document_split_is_disjoint_and_complete(corpus: Dataset) -> None:
    train_range, valid_range = split_documents(len(corpus), 0.1)
    train, valid = TokenStream(corpus, *train_range), TokenStream(corpus, *valid_range)
    assert train.token_end == valid.token_start == int(corpus.doc_offsets[18])
    assert valid.token_end == corpus.num_tokens


def test_global_batch_indices_match_reference_and_are_deterministic() -> None:
    for global_batch_size, num_samples in [(4, 10), (5, 10), (25, 7), (3, 1)]:
        for step in range(12):
            result = global_batch_indices(step, global_batch_size, num_samples, seed=1234)
            assert result.dtype == np.int64 and result.shape == (global_batch_size,)
            assert np.array_equal(result, reference_indices(step, global_batch_size, num_samples, 1234))
    first = global_batch_indices(7, 6, 50, seed=3)
    global_batch_indices(100, 6, 50, seed=3)  # unrelated history must not matter
    dataset_module.epoch_permutation.cache_clear()
    assert np.array_equal(global_batch_indices(7, 6, 50, seed=3), first)
    assert not np.array_equal(global_batch_indices(7, 6, 50, seed=4), first)


def test_each_epoch_is_a_permutation() -> None:
    num_samples, global_batch_size = 30, 7
    steps = [global_batch_indices(step, global_batch_size, num_samples, seed=5) for step in range(3 * num_samples)]
    stream = np.concatenate(steps)
    epochs = stream.reshape(-1, num_samples)  # 3 * 30 * 7 positions = 21 whole epochs
    for epoch in epochs:
        assert np.array_equal(np.sort(epoch), np.arange(num_samples))
    assert not all(np.array_equal(epochs[0], epoch) for epoch in epochs[1:])


def test_far_steps_do_not_materialise_past_epochs() -> None:
    step = 10**12  # ~1e13 positions: only feasible if just the touched epochs are generated
    result = global_batch_indices(step, 8, 1000, seed=0)
    epoch, offset = divmod(step * 8, 1000)
    assert np.array_equal(result, np.random.default_rng([0, epoch]).permutation(1000)[offset : offset + 8])


@pytest.mark.parametrize("step", [0, 1, 9])
def test_micro_batches_are_independent_of_dp_and_micro_batch_size(corpus: Dataset, step: int) -> None:
    samples = SampleSet(TokenStream(corpus, 0, len(corpus)), seq_length=8)
    global_batch_size = 8
    layouts = [(1, 8), (1, 2), (2, 1), (2, 4), (4, 1), (4, 2)]  # (dp, micro_batch_size)
    concatenated = []
    for dp, micro_batch_size in layouts:
        per_rank = [
            micro_batches(samples, step, global_batch_size, micro_batch_size, rank, dp, seed=11) for rank in range(dp)
        ]
        for rank_batches in per_rank:
            assert len(rank_batches) == global_batch_size // (dp * micro_batch_size)
            assert all(inputs.shape == (micro_batch_size, 8) for inputs, _ in rank_batches)
        inputs = torch.cat([batch[0] for rank_batches in per_rank for batch in rank_batches])
        targets = torch.cat([batch[1] for rank_batches in per_rank for batch in rank_batches])
        concatenated.append((inputs, targets))
    expected_inputs, _ = samples.batch(global_batch_indices(step, global_batch_size, len(samples), 11))
    for inputs, targets in concatenated:
        assert torch.equal(inputs, expected_inputs)
        assert torch.equal(targets, concatenated[0][1])


def test_micro_batches_reject_indivisible_batch(corpus: Dataset) -> None:
    samples = SampleSet(TokenStream(corpus, 0, len(corpus)), seq_length=8)
    with pytest.raises(DataError, match="divisible"):
        micro_batches(samples, 0, 10, 4, 0, 1, seed=0)
    with pytest.raises(DataError, match="divisible"):
        micro_batches(samples, 0, 8, 2, 0, 3, seed=0)
    with pytest.raises(DataError):
        micro_batches(samples, 0, 8, 2, 2, 2, seed=0)


def test_eval_batches_are_layout_invariant_and_ordered(corpus: Dataset) -> None:
    samples = SampleSet(TokenStream(corpus, 0, len(corpus)), seq_length=8)
    num_batches, global_eval_batch = 3, 4
    results = []
    for dp in (1, 2, 4):
        per_rank = [eval_batches(samples, num_batches, global_eval_batch // dp, rank, dp) for rank in range(dp)]
        # Order: eval batch by eval batch, each one the ranks' slices in rank order.
        ordered = [per_rank[rank][batch][0] for batch in range(num_batches) for rank in range(dp)]
        results.append(torch.cat(ordered))
    expected, _ = samples.batch(np.arange(num_batches * global_eval_batch))
    for result in results:
        assert torch.equal(result, expected)
    first_call, second_call = eval_batches(samples, 2, 2, 0, 1), eval_batches(samples, 2, 2, 0, 1)
    assert all(torch.equal(first[0], second[0]) for first, second in zip(first_call, second_call))


def test_eval_batches_wrap_around(tmp_path: Path) -> None:
    small = build(tmp_path / "small", [list(range(40)) + [256]])
    samples = SampleSet(TokenStream(small, 0, 1), seq_length=10)  # 4 samples
    batches = eval_batches(samples, num_batches=2, batch_size=3, dp_rank=0, dp=1)
    inputs = torch.cat([batch[0] for batch in batches])
    expected, _ = samples.batch([0, 1, 2, 3, 0, 1])
    assert torch.equal(inputs, expected)


def test_an_epochs_order_takes_four_bytes_a_sample_and_is_numpys_permutation() -> None:
    """Every rank holds the orders of the epochs it is in: int64 cost 4 GB a rank at 500M samples."""
    from megaframe.data.dataset import build_epoch_permutation

    for num_samples in (1, 999, 65_537):
        order = build_epoch_permutation(3, 2, num_samples, stream=4)
        assert order.dtype == np.int32
        assert np.array_equal(order, np.random.default_rng([3, 4, 2]).permutation(num_samples))
