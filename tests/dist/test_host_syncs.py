"""The step loop reads nothing back to the host per micro-batch or per layer: a step of four
micro-batches, or of a model twice as deep, makes as many host reads (the calls that synchronise a
GPU stream) as a step of one micro-batch of the two-layer model."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.support.helpers import TINY
from tests.support.kernel_syncs import KernelSyncs
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
# Tensor methods that copy a value to the host: on CUDA each one waits for the stream.
HOST_READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu")
# ZeRO-3 is left out: DeepSpeed's own stage-3 code reads values back per step on its own.
CASES = {"zero0-fp32": ["zero=stage0"], "zero1-bf16": ["zero=stage1", "precision=bf16"],
         "zero0-bf16": ["zero=stage0", "precision=bf16"],  # DeepSpeed's FP16_Optimizer: its overflow check
         "zero2-fp32": ["zero=stage2"],
         # dropless MoE on one rank keeps the expert counts on the device (ep > 1 reads them: documented)
         "moe-zero1": ["model=moe_tiny", "zero=stage1"],
         # documents found in the token ids and windows on the device (issue 54): no read per micro-batch
         "documents-window": ["zero=stage1", "data.document_mask=true", "data.eod_mask_loss=true",
                              "model.sliding_window=8"]}


def _count_host_reads(rank: int, world: int, run_root: str) -> dict[str, dict[int, Counter]]:
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer

    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    counts: dict[str, dict[int, Counter]] = {}
    for case, extra in CASES.items():
        counts[case] = {}
        for micro_batches, layers in ((1, 2), (4, 2), (1, 4)):
            overrides = [*TINY, *extra, f"parallel.global_batch_size={2 * micro_batches}", "train.eval_interval=0",
                         f"model.num_layers={layers}"]
            cfg, _ = compose(overrides)
            layout = validate_for_engine(cfg, world, ask_bf16=False)
            with Trainer(cfg, layout, Path(run_root) / f"{case}-{micro_batches}") as trainer:
                trainer.train_step()  # first step: lazy optimizer state, one-off reads
                seen: Counter = Counter()
                for name, original in originals.items():
                    def counted(self, *args, _name=name, _original=original, **kwargs):
                        seen[_name] += 1
                        return _original(self, *args, **kwargs)
                    setattr(torch.Tensor, name, counted)
                try:
                    with KernelSyncs() as syncs:  # kernels that read the host inside on CUDA
                        trainer.train_step()
                    seen.update({f"kernel {name}": calls for name, calls in syncs.counts.items()})
                finally:
                    for name, original in originals.items():
                        setattr(torch.Tensor, name, original)
            counts[case][(micro_batches, layers)] = seen
    return counts


def test_a_step_reads_the_host_as_often_with_four_micro_batches_or_twice_the_layers_as_with_one(tmp_path):
    counts = run_ranks(_count_host_reads, 1, tmp_path, run_root=str(tmp_path / "runs"))[0]
    for case, runs in counts.items():
        one, four, deeper = runs[(1, 2)], runs[(4, 2)], runs[(1, 4)]
        assert deeper == one, f"{case}: host reads per step grow with layers: 2 -> {dict(one)}, 4 -> {dict(deeper)}"
        # per step remain: the loss and the gradient norm (ours), DeepSpeed's overflow checks (bf16)
        assert four == one, f"{case}: host reads per step grow with micro-batches: 1 -> {dict(one)}, 4 -> {dict(four)}"
        assert one, f"{case}: no host read counted at all: the counting is broken"
        kernels = {name: calls for name, calls in four.items() if name.startswith("kernel")}
        assert not kernels, f"{case}: kernels that wait for the host on CUDA ran in the step: {kernels}"
