"""docs/data.md "Which samples each step trains on", computed from the doc's four rules (not from
dataset.py) and compared with what each data-parallel rank's micro-batches hold (issue 51)."""
from __future__ import annotations

import numpy as np

from megaframe.data import IndexedDatasetWriter, open_dataset
from megaframe.data.dataset import SampleSet, TokenStream, eval_batches, micro_batches, split_documents


def test_each_rank_trains_and_evaluates_on_what_the_doc_says(tmp_path):
    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 256, size=int(rng.integers(3, 40))).tolist() + [256] for _ in range(30)]
    with IndexedDatasetWriter(tmp_path / "ds") as writer:
        for document in documents:
            writer.add_document(document)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    dataset = open_dataset(tmp_path / "ds")
    (train_start, train_end), (valid_start, valid_end) = split_documents(len(dataset), 0.1)
    S, G, seed, dp, micro = 5, 8, 3, 2, 2
    # the doc's rules: the training side's tokens in document order, samples i*S .. i*S+S, seeded epochs
    tokens = np.concatenate([np.asarray(d) for d in documents[:27]])  # 30 documents, the last 3 held out
    n = (len(tokens) - 1) // S
    chain = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(40 * G // n + 2)])
    train = SampleSet(TokenStream(dataset, train_start, train_end), S)
    for k in range(1, 41):  # several epochs
        step = chain[(k - 1) * G:k * G]
        for r in range(dp):
            share = step[r * G // dp:(r + 1) * G // dp]
            got = micro_batches(train, k - 1, G, micro, r, dp, seed)
            assert len(got) == G // dp // micro
            for m, (inputs, targets) in enumerate(got):
                windows = [tokens[i * S:i * S + S + 1] for i in share[m * micro:(m + 1) * micro]]
                assert inputs.tolist() == [w[:-1].tolist() for w in windows]
                assert targets.tolist() == [w[1:].tolist() for w in windows]
    # evaluation: the validation side's samples in order from 0, each rank its contiguous part of a batch
    held = np.concatenate([np.asarray(d) for d in documents[27:]])
    valid = SampleSet(TokenStream(dataset, valid_start, valid_end), S)
    evaluated = [eval_batches(valid, 2, micro, r, dp) for r in range(dp)]
    order = [evaluated[r][b] for b in range(2) for r in range(dp)]
    samples = [i % valid.num_samples for i in range(2 * micro * dp)]
    assert np.concatenate([inputs.numpy() for inputs, _ in order]).tolist() == [held[i * S:i * S + S].tolist()
                                                                               for i in samples]
