"""How ranks share a checkpoint's files to hash: by bytes (common/file_hash.py hashing_shares)."""
from __future__ import annotations

from megaframe.common.file_hash import hashing_shares
from megaframe.checkpoint.sharded import record_file, shard_file


def _loads(shares, sizes):
    return [sum(sizes[name] for name in share) for share in shares]


def test_shards_and_their_records_are_spread_by_bytes_not_by_count():
    # a layout-free save of 8 ranks: 8 weight shards of 1 GB, each beside a small record, plus the index
    # and state files; in name order shard and record alternate
    sizes = {shard_file(r): 10**9 + r for r in range(8)} | {record_file(r): 2_000 for r in range(8)}
    sizes |= {"index.json": 50_000, "state.json": 1_000}
    shares = hashing_shares(sizes, 8)
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    assert all(share == sorted(share) for share in shares)
    assert max(_loads(shares, sizes)) < 1.01e9  # one shard each (every eighth of the sorted list: two)
    by_count = [sorted(sizes)[r::8] for r in range(8)]
    assert max(_loads(by_count, sizes)) > 2e9


def test_every_rank_computes_the_same_shares_and_a_lone_file_goes_to_one_rank():
    sizes = {"model.safetensors": 10**12, "state.json": 10, "manifest-less.bin": 10}
    assert hashing_shares(sizes, 4) == hashing_shares(dict(reversed(sizes.items())), 4)
    shares = hashing_shares(sizes, 4)
    assert shares[0] == ["model.safetensors"] and sorted(shares[1] + shares[2] + shares[3]) == [
        "manifest-less.bin", "state.json"]
    assert hashing_shares({}, 2) == [[], []] and hashing_shares(sizes, 1) == [sorted(sizes)]
