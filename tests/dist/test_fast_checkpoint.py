"""The fast tier's buddy exchange between real gloo ranks on uneven "nodes" (the ranks that share a
node-local directory): ranks 0 and 1 on node A, rank 2 alone on node B, as Ray places 3 workers
on a 2-CPU head and a 1-CPU node. Every part must end up on the other node, without a deadlock
(rank + LOCAL_WORLD_SIZE paired 1 and 2 with each other and both waited), and node A's loss must
leave a complete set on node B."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow


def _save_two_steps(rank: int, world: int, root: str) -> dict:
    import torch.distributed

    from megaframe.checkpoint import universal
    from megaframe.checkpoint.fast_tier import FastTier

    node = Path(root) / ("node-a" if rank < 2 else "node-b")
    tier = FastTier(node, Path(root) / "run", rank, world)

    def part(step: int):
        def write(directory: Path) -> dict:
            shard = directory / "shards" / f"rank{rank:05d}.safetensors"
            shard.parent.mkdir(parents=True, exist_ok=True)
            shard.write_bytes(f"rank {rank} step {step}".encode() * 1000)
            return {"rank": rank, "files": {shard.relative_to(directory).as_posix(): universal.file_entry(shard)},
                    "tensors": {}}
        return write

    for step in (1, 2):
        tier.save(step, part(step))
    torch.distributed.barrier()  # every rank of the node has dropped its step-1 parts
    return {"buddy": tier.buddy, "senders": tier.senders,
            "held": {step: {r: m["copy"] for r, m in parts.items()} for step, parts in tier.inventory().items()}}


def test_uneven_nodes_swap_parts_and_one_node_holds_a_complete_set(tmp_path):
    results = run_ranks(_save_two_steps, 3, tmp_path, timeout=120, root=str(tmp_path))
    assert [(r["buddy"], r["senders"]) for r in results] == [(2, [2]), (2, []), (0, [0, 1])]
    # node A (ranks 0 and 1): their own parts and rank 2's copy; node B: rank 2's own and copies of 0
    # and 1. Step 1 is gone: each rank drops its older parts once the new ones are done
    assert results[0]["held"] == results[1]["held"] == {2: {0: "own", 1: "own", 2: "buddy"}}
    assert results[2]["held"] == {2: {0: "buddy", 1: "buddy", 2: "own"}}
    copy = tmp_path / "node-b"
    marker = json.loads(next(copy.rglob("rank1.done.json")).read_text())
    shard = next(copy.rglob("rank1/shards/rank00001.safetensors"))
    assert marker["copy"] == "buddy" and shard.read_bytes() == b"rank 1 step 2" * 1000


def _start_tier(rank: int, world: int, root: str) -> str:
    """FastTier's start on this rank: the refusal's line, or 'started'."""
    from megaframe.checkpoint.fast_tier import FastTier
    from megaframe.common.failures import SaveFailed

    try:
        FastTier(Path(root) / ("node-a" if rank < 2 else "node-b"), Path(root) / "run", rank, world)
    except SaveFailed as err:
        return str(err)
    return "started"


def test_one_nodes_untrusted_directory_ends_every_rank_with_its_line(tmp_path):
    """Node B's run directory is writable by anyone (made by another user, say): every rank, node A's
    too, ends with node B's one line at the tier's start, none left waiting for a peer; the same
    three ranks start when it is private (the single-node check is tests/unit/checkpoint)."""
    import os

    from megaframe.checkpoint.fast_tier import run_key

    assert run_ranks(_start_tier, 3, tmp_path, timeout=120, root=str(tmp_path)) == ["started"] * 3
    foreign = tmp_path / "node-b" / run_key(tmp_path / "run")
    os.chmod(foreign, 0o777)
    lines = run_ranks(_start_tier, 3, tmp_path, timeout=120, root=str(tmp_path))
    assert len(set(lines)) == 1 and f"{foreign} is writable by others (mode 777)" in lines[0], lines
