"""A rank that fails mid-run ends the job with its error instead of hanging the others."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import TINY
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow


def _fail_on_rank_1(rank: int, world: int, run_dir: str) -> None:
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    cfg, _ = compose([*TINY, "parallel.dp=2", "train.max_steps=4"])
    with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
        if rank == 1:
            train_step = trainer.train_step

            def failing_step():
                if trainer.step == 2:
                    raise ValueError("injected failure on rank 1")
                return train_step()
            trainer.train_step = failing_step
        trainer.fit()


def test_failing_rank_exits_with_its_error_instead_of_waiting_for_the_others(tmp_path):
    # rank 0 blocks in step 3's collectives; rank 1 must not wait for it in a barrier on the way out
    # rank 0 then fails too ("Connection closed by peer"): the report names the rank that failed first
    with pytest.raises(RuntimeError, match="injected failure on rank 1") as failure:
        run_ranks(_fail_on_rank_1, 2, tmp_path, timeout=120, run_dir=str(tmp_path / "run"))
    assert str(failure.value).startswith("rank 1 failed"), str(failure.value)[:300]
