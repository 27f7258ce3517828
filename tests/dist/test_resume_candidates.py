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


def _train_and_report_the_first_step(rank: int, world: int, overrides: list[str], run_dir: str) -> int:
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    cfg, _ = compose(overrides)
    trainer = Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir))
    first, take_step = [], trainer.train_step

    def recording_step():
        first.append(trainer.step)
        return take_step()
    trainer.train_step = recording_step
    with trainer:
        trainer.fit()
    return first[0]


def test_a_checkpoint_a_crash_left_aside_mid_swap_is_put_back_and_resumed_from(tmp_path, capfd):
    """Saving a step that already has a checkpoint (a stop right after a resume saves it again) moves
    the old copy to tmp-old-global_stepN, renames the new one in, then deletes the old. A crash
    between the two renames left neither under the name: the resume fell back to an older step and
    the aside copy stayed on the storage for good. Now it is renamed back and resumed from."""
    import shutil

    from tests.support.helpers import TINY

    base = [*TINY, "train.max_steps=6", "train.eval_interval=0", "train.save_interval=2"]
    run_dir = tmp_path / "run"
    run_ranks(_train_and_report_the_first_step, 1, tmp_path, overrides=[*base, "train.exit_at_step=4"],
              run_dir=str(run_dir))
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step4"
    # the crash: step 4 saved again, its old copy moved aside, the new one complete but not renamed in
    shutil.copytree(checkpoints / "global_step4", checkpoints / "tmp-global_step4")
    (checkpoints / "global_step4").rename(checkpoints / "tmp-old-global_step4")
    (first,) = run_ranks(_train_and_report_the_first_step, 1, tmp_path, overrides=base, run_dir=str(run_dir))
    assert first == 4, first  # the first step taken goes from 4 to 5: resumed at 4, not at 2
    assert "global_step4 was left aside by a crash while it was being saved again: put back" in capfd.readouterr().err
    # the new copy went to the trash, which the next publish emptied: no checkpoint's bytes are left behind
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step2", "global_step4", "global_step6", "latest"]
