"""What every rank settles before it trains: that the run dir is this run's alone (run_lock.py)
and that every token id of the data fits the model's vocabulary (data/token_check.py). Both end
the run on every rank with one line, before anything is written to the run dir or a step taken."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megaframe.common import run_lock
from megaframe.data.token_check import check_token_ids, dataset_token_ranges
from megaframe.common.failures import RunDirInUse
from megaframe.parallel.rank_zero import decided_by_rank_zero


def own_run_dir(run_dir: Path) -> None:
    """Rank 0 locks the run dir unless our launcher holds it for us; every rank learns the answer,
    so a second run on a busy run dir ends on all ranks with one line (RunDirInUse). A collective."""
    problem = decided_by_rank_zero(lambda: None if run_lock.held_by_parent(run_dir) else run_lock.acquire(run_dir))
    if problem is not None:
        raise RunDirInUse(problem)


def check_token_ids_fit(datasets: list, vocab_size: int, vocab_set: bool, device: torch.device,
                        rank: int, world_size: int) -> None:
    """Every token id in [0, vocab_size), before step 1 and on every rank, whatever the layout: the
    ranks scan 1/world of the tokens each and reduce the extremes in one collective, at every start
    (the content, never a cache keyed on file metadata). vocab_set: model.vocab_size was given, so
    the error names that key rather than the dataset's source of the vocabulary."""
    def reduce_max(local):
        extremes = torch.from_numpy(local).to(device)
        if world_size > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        return extremes.cpu().numpy()
    for dataset, found in zip(datasets, dataset_token_ranges(datasets, rank, world_size, reduce_max)):
        check_token_ids(dataset, found, vocab_size, "model.vocab_size" if vocab_set else dataset.vocab_source)
