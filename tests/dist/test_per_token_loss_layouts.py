"""data.eod_mask_loss through the engines' layouts: the loss per counted target of the global batch
(Megatron-LM's --calculate-per-token-loss) at dp=2 (DeepSpeed ZeRO-1 and FSDP2), at cp=2 and at
pp=2 (both engines' schedules), each at micro-batch 1, follows the one-rank run whose one
micro-batch is the whole global batch (its plain mean is the per-target mean). Every logged loss,
gradient norm and eval loss within tests/support/parity.py's rtol. The micro-batches' own means,
weighed alike, missed that bound (tests/unit/backends/test_per_token_loss.py: 5e-5 at micro-batch 1).
Short documents, so every sample holds several ends of document. Real gloo ranks."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.support.parity import FLAVOURS, assert_parity, train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs
from tests.support.short_documents import write_short_documents

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=4", "train.eval_interval=2", "train.eval_steps=2", "parallel.global_batch_size=8"]
LAYOUTS = {"deepspeed-zero1-dp2": ["zero=stage1"],
           "fsdp2-dp2": ["backend=fsdp2", "zero=stage3"],
           "deepspeed-cp2": ["parallel.cp=2", "zero=stage1"],
           "deepspeed-pp2": ["parallel.pp=2", "zero=stage1"],
           "fsdp2-pp2": ["backend=fsdp2", "parallel.pp=2", "zero=stage3"]}


def test_every_layout_trains_the_loss_per_counted_target_of_the_one_rank_run(tmp_path_factory, tmp_path):
    corpus = write_short_documents(tmp_path / "short")
    base = [*TINY, *FLAVOURS["llama"], *STEPS, "data.eod_mask_loss=true", f"data.path={corpus}"]
    (reference,) = reference_runs({"one": [*base, "parallel.micro_batch_size=8"]},
                                  tmp_path_factory.mktemp("single")).values()
    runs = [([*base, *extra, "parallel.micro_batch_size=1"], str(tmp_path / name)) for name, extra in LAYOUTS.items()]
    run_ranks(train_runs, 2, tmp_path, timeout=900, runs=runs)
    for _, run_dir in runs:
        assert_parity(read_metrics(run_dir), read_metrics(reference), Path(run_dir).name)
