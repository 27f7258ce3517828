"""train.resume=auto picks one checkpoint for every rank: rank 0 lists the candidates on shared
storage and the ranks verify that list together. Each rank listed for itself before, and a client
whose directory cache lagged (NFS, Lustre) verified other checkpoints than its peers."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow


def _resume_with_a_lagging_listing(rank: int, world: int, save_dir: str) -> str:
    import torch.distributed as dist

    from megaframe.checkpoint import store

    class Engine:
        def save_native(self, directory, tag, client_state) -> None:
            pass

    for step in (2, 4):
        store.save(Engine(), Path(save_dir), step, {"step": step}, native=False)
    dist.barrier()
    if rank == 1:  # this client's cache still shows the directory as it was before step 4's save
        store.find_latest = lambda directory: Path(directory) / "global_step2"
        store._complete_checkpoints = lambda directory: [(2, Path(directory) / "global_step2")]
    path, skipped = store.newest_verified(Path(save_dir))
    return f"{path.name} {skipped}"


def test_every_rank_resumes_from_the_checkpoint_rank_0_lists(tmp_path):
    results = run_ranks(_resume_with_a_lagging_listing, 2, tmp_path, timeout=120, save_dir=str(tmp_path / "ckpt"))
    assert results == ["global_step4 []", "global_step4 []"], results
