"""The sha256 of a file, for checkpoint manifests, tokenizer records and dataset sidecars: a leaf all
of them import (the manifest writer, universal.py, imports the tokenizer record, so the record cannot
import it; data/ may not import checkpoint/)."""
from __future__ import annotations

import hashlib
import heapq
from pathlib import Path


def hash_file(path: Path) -> str:
    """The sha256 of a file's content (hex), read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hashing_shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files split over `world` ranks to hash, by bytes: the largest first, each to the rank with
    the fewest bytes so far (ties to the lower rank), each share in name order. Every world-th file of
    the sorted list gave half the ranks two weight shards and the other half the small record files
    beside them (shard and record names alternate), so a verify took the time of the largest pair."""
    loads = [(0, rank) for rank in range(world)]
    shares: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(name)
        heapq.heappush(loads, (load + sizes[name], rank))
    return [sorted(share) for share in shares]
