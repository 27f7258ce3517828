"""A host-sync budget on the CUDA-shaped device: a training step makes as many device-to-host reads with
four micro-batches as with one, and with four layers as with two. The device counts every read,
including those tests/dist/test_host_syncs.py cannot see (copies to host tensors, kernels that read
a size back inside, such as bincount and nonzero), each with its call site."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.fakecuda.env import fake_cuda_env
from tests.support.helpers import REPO, TINY

pytestmark = pytest.mark.slow
CASES = {"zero0-fp32": ["zero=stage0"], "zero1-bf16": ["zero=stage1", "precision=bf16"],
         "zero2-fp32": ["zero=stage2"],
         # bf16: the experts' grouped GEMM (sm90). In fp32 CUDA has none, and the loop over experts reads the
         # counts once per layer and micro-batch (documented in model/moe.py): not held to this budget
         "moe-zero1-bf16": ["model=moe_tiny", "zero=stage1", "precision=bf16"],
         # fp8 kernels (torch._scaled_mm, precision.fp8.emulate=auto on the device): its scales stay on the device
         "zero1-fp8": ["zero=stage1", "precision=fp8"],
         # Muon on DeepSpeed's flat partition (described to Muon): momentum, Newton-Schulz and its
         # owners' exchange per step, none of them read back per matrix
         "zero1-muon": ["zero=stage1", "optim=muon"]}
SHAPES = [(1, 2), (4, 2), (1, 4)]  # (micro-batches per step, layers)

COUNT = """
import json, sys
from pathlib import Path
from tests.support.fakecuda import ledger
from megaframe.config.compose import compose
from megaframe.backends.registry import validate_for_engine
from megaframe.training.trainer import Trainer

root, cases, shapes, tiny = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
counts = {}
for case, extra in cases.items():
    for micro, layers in shapes:
        overrides = [*tiny, *extra, f"parallel.global_batch_size={2 * micro}", f"model.num_layers={layers}",
                     "train.eval_interval=0"]
        cfg, _ = compose(overrides)
        with Trainer(cfg, validate_for_engine(cfg, 1, ask_bf16=False), root / f"{case}-{micro}-{layers}") as trainer:
            trainer.train_step()  # the first step: lazy optimizer state, one-off reads
            before = dict(ledger.syncs)
            trainer.train_step()
            seen = {f"{kind} @ {site}": n - before.get((kind, site), 0) for (kind, site), n in ledger.syncs.items()
                    if n - before.get((kind, site), 0)}
        counts[f"{case} micro={micro} layers={layers}"] = seen
print("COUNTS " + json.dumps({"counts": counts, "violations": ledger.violations}))
"""


def count_syncs(root, cases: dict, shapes: list, **env: str) -> dict:
    """Host reads of each case's second step, per (micro-batches, layers), in one process on the device."""
    result = subprocess.run([sys.executable, "-c", COUNT, str(root), json.dumps(cases), json.dumps(shapes),
                             json.dumps(TINY)], cwd=REPO, env=fake_cuda_env(root / "reports", **env),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("COUNTS "))
    return json.loads(line[len("COUNTS "):])


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return count_syncs(tmp_path_factory.mktemp("budget"), CASES, SHAPES)


def test_no_violation_while_counting(counts):
    assert counts["violations"] == []


@pytest.mark.parametrize("case", list(CASES))
def test_host_reads_per_step_do_not_grow_with_micro_batches_or_layers(case, counts):
    by_shape = {shape: counts["counts"][f"{case} micro={shape[0]} layers={shape[1]}"] for shape in SHAPES}
    one = by_shape[(1, 2)]
    assert one, f"{case}: no host read counted at all: the counting is broken"
    assert by_shape[(4, 2)] == one, f"{case}: host reads per step grow with micro-batches: {one} -> {by_shape[(4, 2)]}"
    assert by_shape[(1, 4)] == one, f"{case}: host reads per step grow with layers: {one} -> {by_shape[(1, 4)]}"


def test_an_fp8_step_reads_the_host_exactly_where_a_bf16_step_does(counts):
    """fp8's scales (amaxes, their TP reduction) are computed and applied on the device: no new read."""
    for micro, layers in SHAPES:
        fp8, bf16 = (counts["counts"][f"{case} micro={micro} layers={layers}"] for case in ("zero1-fp8", "zero1-bf16"))
        assert fp8 == bf16, f"micro={micro} layers={layers}: fp8 reads {fp8}, bf16 {bf16}"


def test_the_budget_catches_a_read_per_micro_batch(tmp_path):
    """The seeded bug (tests/support/fakecuda/mutants.py) reads each micro-batch's loss: 4 micro-batches, 3 more reads."""
    found = count_syncs(tmp_path, {"zero1": ["zero=stage1"]}, [(1, 2), (4, 2)],
                        MEGAFRAME_FAKE_CUDA_MUTANT="item_per_micro_batch")["counts"]
    one, four = found["zero1 micro=1 layers=2"], found["zero1 micro=4 layers=2"]
    assert sum(four.values()) == sum(one.values()) + 3, (one, four)
    # named at the step loop's line that called the bugged gate (the tier's own frames are skipped)
    assert [n for site, n in four.items() if "deepspeed/engine.py" in site and "(train_step)" in site] == [4], four
