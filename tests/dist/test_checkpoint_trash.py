"""Pruning to train.keep_checkpoints: rank 0 deletes the pruned checkpoints on a thread, so that no
rank waits on the delete. A pruned checkpoint with optimizer states is about 16 bytes a parameter
(1.1 TB at 70B) in thousands of files, minutes on a parallel file system; rank 0 deleted it between
a save's last two barriers, so every other rank waited there (past the collective timeout, a hang
blamed on rank 0). Here rank 0's delete cannot finish until rank 1 says it got past the save."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow


def _saves_with_a_delete_that_waits_for_rank_1(rank: int, world: int, save_dir: str, signal: str,
                                               collector: bool, patience_s: float) -> dict:
    """Two saves at keep=1; rank 0's delete of the pruned step 1 waits up to patience_s for rank 1."""
    from megaframe.checkpoint import store

    seen: dict = {}
    if rank == 0:
        real = store.empty_trash

        def waiting_for_rank_1(directory):
            if list(Path(directory).glob(store.TRASH_PREFIX + "*")):  # the pruned checkpoint is there
                deadline = time.monotonic() + patience_s
                while not Path(signal).exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                seen["rank 1 went on"] = Path(signal).exists()
            real(directory)

        store.empty_trash = waiting_for_rank_1
    trash = store.TrashCollector() if collector else None
    for step in (1, 2):
        store.save(None, Path(save_dir), step, {"step": step}, native=False, keep=1, trash=trash)
    if rank == 1:
        Path(signal).write_text("rank 1 is past the saves\n")
    elif trash is not None:
        trash.wait()
        seen["left"] = sorted(p.name for p in Path(save_dir).iterdir())
    return seen


def test_no_rank_waits_for_rank_0_to_delete_a_pruned_checkpoint(tmp_path):
    save_dir = tmp_path / "checkpoints"
    seen = run_ranks(_saves_with_a_delete_that_waits_for_rank_1, 2, tmp_path, save_dir=str(save_dir),
                     signal=str(tmp_path / "rank1-went-on"), collector=True, patience_s=20.0)[0]
    assert seen["rank 1 went on"], "rank 1 waited in the save while rank 0 deleted the pruned checkpoint"
    assert seen["left"] == ["global_step2", "latest"]  # step 1 pruned, deleted once rank 0's thread was let go


def test_without_a_collector_the_publish_deletes_before_the_last_barrier(tmp_path):
    """The same saves with no collector (a publish outside a run): the delete is the publish's own,
    and rank 1 cannot go on before it, which is what the collector takes off the ranks' path."""
    seen = run_ranks(_saves_with_a_delete_that_waits_for_rank_1, 2, tmp_path, save_dir=str(tmp_path / "ck"),
                     signal=str(tmp_path / "rank1-went-on"), collector=False, patience_s=1.0)[0]
    assert seen["rank 1 went on"] is False
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["global_step2", "latest"]
