"""A background save (train.async_save) on the CUDA-shaped device: the step loop queues its copies to
page-locked host buffers and does not wait for them, and the writer writes the values of the save's step.

The device lands a non-blocking download only when the host waits for it (tests/support/fakecuda/downloads.py),
so a writer that read its buffers without waiting would write NaNs; one that read the live tensors would
write a later step's values. Each case saves step 1 in the background and waits for it with no host wait
of its own in between (a read in the step loop lands every copy, as on CUDA), then saves step 2 and
trains two more steps while the writer runs: both must be exactly what synchronous saves of those steps
write, and the second save must reuse the first's host buffers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.fakecuda.env import fake_cuda_env
from tests.support.helpers import REPO, TINY

pytestmark = pytest.mark.slow
CASES = {"zero0": ["zero=stage0"], "zero1-bf16": ["zero=stage1", "precision=bf16"], "zero3": ["zero=stage3"],
         "fsdp2-stage3": ["backend=fsdp2", "zero=stage3"],
         # masters and moments in host memory: copied at once into pageable buffers (pinning them takes
         # host RAM from the offloaded states for nothing), the device's weights queued as elsewhere
         "zero2-bf16-cpu-offload": ["zero=stage2", "precision=bf16", "offload=cpu"]}
OFFLOADED = {"zero2-bf16-cpu-offload"}
LAYERS = [2, 4]

SAVE = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from tests.support.fakecuda import downloads, ledger
from megaframe.config.compose import compose
from megaframe.backends.registry import validate_for_engine
from megaframe.training.trainer import Trainer

root = Path(sys.argv[1])
cases, layers_list, tiny = (json.loads(arg) for arg in sys.argv[2:5])
found = {}
for case, extra in cases.items():
    for layers in layers_list:
        shards, report = {}, {}
        for mode in ("async", "sync"):
            cfg, _ = compose([*tiny, *extra, f"model.num_layers={layers}", "train.eval_interval=0",
                              f"train.async_save={'true' if mode == 'async' else 'false'}"])
            run = root / f"{case}-{layers}-{mode}"
            with Trainer(cfg, validate_for_engine(cfg, 1, ask_bf16=False), run) as trainer:
                trainer.train_step()
                before, landed = dict(ledger.syncs), dict(downloads.landed_by)
                trainer.checkpoints.save(trainer.step)  # returns once the copies are queued (async)
                syncs = {f"{kind} @ {site}": n - before.get((kind, site), 0) for (kind, site), n in ledger.syncs.items()
                         if n - before.get((kind, site), 0)}
                # no host wait here (a join): only the writer's own wait lands its copies
                trainer.checkpoints.wait()
                waited_by = {name: n - landed.get(name, 0) for name, n in downloads.landed_by.items()
                             if n - landed.get(name, 0)}
                staging = trainer.checkpoints.staging
                slabs = [s.data_ptr() for s in (*staging.pinned_slabs, *staging.host_slabs)] if staging else []
                trainer.train_step()
                trainer.checkpoints.save(trainer.step)
                trainer.train_step()  # changes every tensor the save copied, while the writer runs
                trainer.train_step()
                trainer.checkpoints.wait()
                if mode == "async":
                    report = {"syncs": syncs, "waited_by": waited_by,
                              "pinned": [slab.is_pinned() for slab in staging.pinned_slabs],
                              "pageable": [slab.is_pinned() for slab in staging.host_slabs],
                              "reused": [s.data_ptr() for s in (*staging.pinned_slabs, *staging.host_slabs)] == slabs
                              and bool(slabs)}
            for step in (1, 2):
                files = (run / "checkpoints" / f"global_step{step}" / "shards").glob("rank00000*.safetensors")
                shards[mode, step] = {k: v for f in sorted(files) for k, v in load_file(str(f)).items()}
        report["same_keys"] = all(sorted(shards["async", step]) == sorted(shards["sync", step]) and shards["sync", step]
                                  for step in (1, 2))
        report["differ"] = sorted(f"step {step}: {k}" for step in (1, 2) for k, want in shards["sync", step].items()
                                  if k in shards["async", step] and not torch.equal(shards["async", step][k], want))
        found[f"{case} layers={layers}"] = report
print("FOUND " + json.dumps({"found": found, "violations": ledger.violations}))
"""


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    root = tmp_path_factory.mktemp("async-save")
    args = [json.dumps(CASES), json.dumps(LAYERS), json.dumps(TINY)]
    result = subprocess.run([sys.executable, "-c", SAVE, str(root), *args], cwd=REPO,
                            env=fake_cuda_env(root / "reports"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("FOUND "))
    return json.loads(line[len("FOUND "):])


def test_no_violation(found):
    assert found["violations"] == []


@pytest.mark.parametrize("case", list(CASES))
def test_the_background_save_writes_the_values_of_its_step(case, found):
    for layers in LAYERS:
        report = found["found"][f"{case} layers={layers}"]
        assert report["same_keys"], f"{case}: the background save wrote other tensors than the synchronous one"
        assert report["differ"] == [], f"{case} layers={layers}: written from other values: {report['differ']}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_loop_waits_for_no_copy_and_the_buffers_are_pinned_and_kept(case, found):
    two, four = (found["found"][f"{case} layers={layers}"] for layers in LAYERS)
    # a blocking copy per tensor would add a host wait per parameter and optimizer tensor with the layers
    assert two["syncs"] == four["syncs"], f"{case}: host reads in a save grow with the layers: {two} -> {four}"
    assert not [site for site in two["syncs"] if "to host" in site], f"{case}: a save waited for a copy: {two['syncs']}"
    # every queued copy was waited for by the writer's thread, none by the step loop's (a read after them)
    for report in (two, four):
        assert report["waited_by"] and all(name.startswith("megaframe-save") for name in report["waited_by"]), \
            f"{case}: the copies were waited for by {report['waited_by']}"
    for report in (two, four):
        assert report["pinned"] and all(report["pinned"]), f"{case}: the device's copies are not page-locked"
        # host tensors (offloaded states) go to pageable buffers; without offload there are none
        assert (bool(report["pageable"]) == (case in OFFLOADED)) and not any(report["pageable"]), report
        assert report["reused"], f"{case}: a second save allocated new host buffers"
