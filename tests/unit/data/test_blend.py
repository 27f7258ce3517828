"""Weighted blends (data/blend.py) against Megatron-LM's own blending code, and their layout
invariance and resumability."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megaframe.data import DataError, IndexedDatasetWriter, SampleSet, TokenStream, micro_batches, open_dataset
from megaframe.data.blend import BlendedSamples, Stage, normalized, parse_blend

SEQ = 8


def sample_set(prefix: Path, first_token: int, documents: int) -> SampleSet:
    """Documents of 33 tokens whose ids say which source they come from (first_token .. first_token+32)."""
    with IndexedDatasetWriter(prefix) as writer:
        for _ in range(documents):
            writer.add_document(np.arange(first_token, first_token + 33) % 257)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    dataset = open_dataset(prefix)
    return SampleSet(TokenStream(dataset, 0, len(dataset)), SEQ)


@pytest.fixture
def sources(tmp_path) -> list[SampleSet]:
    return [sample_set(tmp_path / "a", 0, 10), sample_set(tmp_path / "b", 100, 17), sample_set(tmp_path / "c", 200, 5)]


def blend(sources, weights, schedule=(), shuffle=True) -> BlendedSamples:
    stages = [Stage(0, tuple(normalized(weights)))] + [Stage(step, tuple(normalized(w))) for step, w in schedule]
    return BlendedSamples(sources[:len(weights)], stages, [f"s{i}" for i in range(len(weights))], shuffle=shuffle)


def walk(samples: BlendedSamples, steps: int, batch: int, seed: int = 7) -> np.ndarray:
    return np.concatenate([samples.step_indices(step, batch, seed) for step in range(steps)])


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.5, 0.3], [1.0, 1.0, 1.0], [3, 1]])
def test_each_sample_comes_from_the_source_megatron_picks(sources, weights):
    """Megatron-LM's C++ build_blending_indices (megatron-core) is the reference: the same source
    and the same per-source sample number at every one of 10,000 positions."""
    from megatron.core.datasets import helpers_cpp

    size = 10_000
    theirs_source = np.zeros(size, dtype=np.int16)
    theirs_ordinal = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(theirs_source, theirs_ordinal, np.array(normalized(weights)), len(weights),
                                       size, False)
    samples = blend(sources, weights, shuffle=False)
    ours = walk(samples, steps=size // 100, batch=100)
    assert np.array_equal(ours[:, 0], theirs_source)
    counts = [len(sources[s]) for s in ours[:, 0]]
    assert np.array_equal(ours[:, 1], theirs_ordinal % counts)  # unshuffled: ordinal n is sample n mod N


def test_realised_shares_of_a_03_07_blend_are_within_1_percent(sources):
    picks = walk(blend(sources, [0.3, 0.7]), steps=100, batch=100)
    shares = np.bincount(picks[:, 0], minlength=2) / len(picks)
    assert abs(shares[0] - 0.3) < 0.01 and abs(shares[1] - 0.7) < 0.01, shares
    # and the tokens say so too: source a's windows hold ids < 100, b's ids >= 100
    inputs, _ = blend(sources, [0.3, 0.7]).batch(picks[:1000])
    assert np.array_equal((inputs[:, 0] < 100).numpy(), picks[:1000, 0] == 0)


def test_each_source_goes_through_a_whole_epoch_before_repeating(sources):
    picks = walk(blend(sources, [0.2, 0.5, 0.3]), steps=40, batch=64)
    for source in range(3):
        indices = picks[picks[:, 0] == source, 1]
        count = len(sources[source])
        for epoch in range(len(indices) // count):
            assert sorted(indices[epoch * count:(epoch + 1) * count]) == list(range(count))


def test_dp_slices_and_micro_batches_concatenate_to_the_dp1_step(sources):
    samples = blend(sources, [0.3, 0.7])
    for step in (0, 3, 11):
        whole = micro_batches(samples, step, 16, 16, 0, 1, seed=5)[0]
        parts = [b for rank in range(4) for b in micro_batches(samples, step, 16, 2, rank, 4, seed=5)]
        assert all(np.array_equal(np.concatenate([p[i] for p in parts]), whole[i]) for i in range(2))


def test_any_step_is_a_pure_function_of_seed_step_and_batch_size(sources):
    schedule = [(6, [0.9, 0.1, 0.0]), (9, [0.2, 0.2, 0.6])]
    uninterrupted = walk(blend(sources, [0.3, 0.5, 0.2], schedule), steps=14, batch=12)
    fresh = blend(sources, [0.3, 0.5, 0.2], schedule)  # a resumed run: nothing walked before step 10
    assert np.array_equal(fresh.step_indices(10, 12, 7), uninterrupted[120:132])
    assert np.array_equal(fresh.step_indices(3, 12, 7), uninterrupted[36:48])  # and backwards
    saved = blend(sources, [0.3, 0.5, 0.2], schedule)
    saved.step_indices(7, 12, 7)
    state = saved.cursor_at(8 * 12, 12).state_dict()  # what a checkpoint at step 8 stores
    restored = blend(sources, [0.3, 0.5, 0.2], schedule)
    restored.restore(state)
    assert np.array_equal(np.concatenate([restored.step_indices(s, 12, 7) for s in range(8, 14)]), uninterrupted[96:])
    assert restored.cursor_at(14 * 12, 12).position == 14 * 12 and restored._cursor.position == 14 * 12


def test_a_schedule_stage_starts_its_shares_afresh(sources):
    samples = blend(sources, [0.5, 0.5], schedule=[(50, [0.1, 0.9])])
    picks = walk(samples, steps=100, batch=20)
    first, second = picks[:1000, 0], picks[1000:, 0]
    assert abs(np.mean(first == 0) - 0.5) < 0.01
    assert abs(np.mean(second == 0) - 0.1) < 0.01  # not dragged toward the cumulative 0.1 target
    # within the second stage, every prefix of it has the stage's shares (no catching up at its start)
    assert abs(np.mean(second[:100] == 0) - 0.1) < 0.011
    tokens = samples.consumed_tokens(100, 20)
    assert tokens == {"s0": int(np.sum(picks[:, 0] == 0)) * SEQ, "s1": int(np.sum(picks[:, 0] == 1)) * SEQ}


def test_evaluation_order_is_the_blend_unshuffled(sources):
    samples = blend(sources, [0.3, 0.7])
    ordered = samples.ordered(np.arange(20))
    unshuffled = walk(blend(sources, [0.3, 0.7], shuffle=False), steps=1, batch=20)
    assert np.array_equal(ordered, unshuffled)
    assert np.array_equal(samples.ordered(np.array([5, 2])), unshuffled[[5, 2]])


@pytest.mark.parametrize("bad, message", [
    ([0.3, "/a", 0.7], "in pairs"),
    (["/a", 0.3], r"weight '/a' \(of 0.3\) must be a number"),
    ([-1, "/a", 2, "/b"], "must be a number >= 0"),
    ([0, "/a", 0, "/b"], "sum to 0"),
    ([0.5, 3, 0.5, "/b"], "must be a dataset prefix"),
])
def test_malformed_blends_name_the_key_and_the_form(bad, message):
    with pytest.raises(DataError, match=message) as error:
        parse_blend(bad)
    assert str(error.value).startswith("data.blend")


def test_a_lone_prefix_is_weight_one():
    assert parse_blend(["/data/a"]) == ([1.0], ["/data/a"])
    assert parse_blend([1, "/a", 3, "/b"]) == ([1.0, 3.0], ["/a", "/b"])


def test_a_blend_of_many_sources_builds_each_sources_epoch_order_once(tmp_path, monkeypatch):
    """A step walks every source in turn; the orders were kept in one process-wide cache of 16, so
    with 17 or more sources each source's epoch order was rebuilt on every step (a permutation of
    every sample of the source: seconds at millions of samples, on every rank). Now each order is
    built once while the walk is in its epoch, and the picks are those of a fresh blend per step (a
    resumed run's), under any seed."""
    import megaframe.data.epoch_orders as orders_module

    many = [sample_set(tmp_path / f"s{i}", i, 3 + i % 4) for i in range(20)]
    built = []

    def counted(seed, epoch, count, stream=0):
        built.append((stream, epoch))
        return build(seed, epoch, count, stream)

    build = orders_module.build_epoch_permutation
    monkeypatch.setattr(orders_module, "build_epoch_permutation", counted)
    weights = [1.0] * len(many)
    samples = blend(many, weights)
    steps = walk(samples, steps=12, batch=40)
    assert len(built) == len(set(built)), "an epoch order was built twice"
    assert {s - 1 for s, _ in built} == set(range(len(many)))
    resumed = np.concatenate([blend(many, weights).step_indices(step, 40, 7) for step in range(12)])
    assert np.array_equal(steps, resumed)
    other_seed = samples.step_indices(5, 40, 8)  # the same blend asked under another seed
    assert np.array_equal(other_seed, blend(many, weights).step_indices(5, 40, 8))
    assert not np.array_equal(other_seed, steps[200:240])


@pytest.mark.parametrize("weights", [[0.9, 0.1], [0.5, 0.5], [0.2, 0.5, 0.3]])
def test_the_evaluation_wrap_check_counts_the_samples_before_a_source_repeats(sources, weights):
    """A blended validation set repeats a source's samples once its weight has drawn more than the
    source holds, long before len(blend) positions when the weights do not follow the sizes: with
    weights 0.9/0.1 over sources of 40 and 68 samples, 80 positions draw 72 from the first. The
    check (eval_wrap_problem) is given the positions an evaluation takes before one repeats, which
    the evaluation order itself confirms to within one sample of a source."""
    from megaframe.data.dataset import eval_wrap_problem

    samples = blend(sources, weights)
    before = samples.samples_before_a_repeat()
    picks = samples.ordered(np.arange(len(samples)))

    def repeats(n: int) -> bool:
        return len({tuple(row) for row in picks[:n]}) < n

    slack = int(1 / min(normalized(weights))) + 1  # one sample of the lightest source, in positions
    assert not repeats(before - 1) and repeats(before + slack), (before, len(samples))
    if weights == [0.9, 0.1]:
        assert before < len(samples) // 2
        assert eval_wrap_problem(1, before + 2, before) is not None


@pytest.mark.parametrize("count", [16, 40])
def test_a_blend_of_many_sources_picks_what_megatron_picks(tmp_path, monkeypatch, count):
    """From 16 sources on a pick is one array expression (data/blend.py's _walk_arrays): against
    Megatron-LM's C++ build_blending_indices at every one of 5,000 positions, with weights drawn at
    random and with equal weights (ties go to the first source), across a schedule stage."""
    from megatron.core.datasets import helpers_cpp

    many = [sample_set(tmp_path / f"s{i}", i, 2) for i in range(count)]
    for weights in (list(np.random.default_rng(count).dirichlet(np.ones(count))), [1.0] * count):
        size = 5_000
        theirs = np.zeros(size, dtype=np.int16)
        ordinals = np.zeros(size, dtype=np.int64)
        helpers_cpp.build_blending_indices(theirs, ordinals, np.array(normalized(weights)), count, size, False)
        ours = walk(blend(many, weights, shuffle=False), steps=size // 50, batch=50)
        assert np.array_equal(ours[:, 0], theirs)
        assert np.array_equal(ours[:, 1], ordinals % [len(many[s]) for s in ours[:, 0]])
    # a stage boundary: the second stage's shares start afresh, as the loop over the sources has them
    import megaframe.data.blend as blend_module

    schedule = [(7, list(np.random.default_rng(1).dirichlet(np.ones(count))))]
    walked = walk(blend(many, weights, schedule=schedule), steps=20, batch=30)
    monkeypatch.setattr(blend_module, "_ARRAY_PICK_SOURCES", 1 << 30)  # the loop, for any count
    assert np.array_equal(walked, walk(blend(many, weights, schedule=schedule), steps=20, batch=30))


def test_a_blend_walks_the_same_samples_with_its_orders_shared_through_a_file(sources, tmp_path):
    """data.cache_dir's shared orders (epoch_orders.py) give each source the order it had in memory:
    over several epochs of every source, the same (source, sample) picks; one file per source and epoch."""
    from megaframe.data.epoch_orders import EpochOrders

    stages = [Stage(0, tuple(normalized([0.2, 0.5, 0.3])))]
    names = ["s0", "s1", "s2"]
    shared = BlendedSamples(sources, stages, names, orders=EpochOrders(tmp_path / "orders", shared_from=1))
    reached, told = shared.orders.reached, []

    def telling(seed, epoch, count, stream, position):  # how far each source's epoch got, for the build ahead
        told.append((stream, epoch, position))
        reached(seed, epoch, count, stream, position)
    shared.orders.reached = telling
    np.testing.assert_array_equal(walk(shared, 12, 8), walk(BlendedSamples(sources, stages, names), 12, 8))
    assert {stream for stream, _, _ in told} == {1, 2, 3}
    assert all(0 < position <= len(sources[stream - 1]) for stream, _, position in told)
    for thread in shared.orders.prefetches:  # the next epochs' orders, built on threads one at a time
        thread.join(60)
    ahead = [(stream, epoch) for stream, epoch, position in told if position >= 0.9 * len(sources[stream - 1])]
    assert ahead and all(shared.orders.path(7, epoch + 1, len(sources[stream - 1]), stream).exists()
                         for stream, epoch in ahead), ahead
    files = sorted(p.name for p in (tmp_path / "orders").glob("*.npy"))
    assert {name.split("-stream")[1][0] for name in files} == {"1", "2", "3"} and len(files) > 3, files
