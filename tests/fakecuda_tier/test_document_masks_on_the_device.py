"""Document masking on the CUDA-shaped device (tests/support/fakecuda) at cp=2 ring, tp=2 and pp=2 x cp=2 (issue 54):
each run has no violation, trains the plain CPU run's curve with the same keys (loss, gradient norm,
eval loss at rtol 1e-5), and makes exactly the host reads, at the same call sites, and the same bytes of
host-to-device copies per rank as the same layout without document masking: the documents found on the
device (and, under cp, the all-gather of the rows' token ids, the ring's pieces and the loss weights)
add none."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.support.fakecuda.ledger import read_reports
from tests.support.fakecuda.runs import run_on_device
from tests.support.parity import assert_parity
from tests.support.fakecuda.runs import cpu_run
from tests.support.short_documents import write_short_documents

pytestmark = pytest.mark.slow
DOCUMENTS = ["data.document_mask=true", "data.eod_mask_loss=true"]
# name: (keys, world, the run without documents' own keys). DeepSpeed's pipeline stages over cp shards
# gather the rows' ids per stage. Its layers hand the token ids along wherever attention is masked, and
# DeepSpeed reads the shapes of what a stage receives once per buffer (_recv_tensor_meta): the run
# without documents carries them too, with a window as long as the sequence (no window at all,
# model/dims.py window_of), so that the comparison isolates what the documents add.
LAYOUTS = {"cp2-ring": (["parallel.cp=2"], 2, []),
           "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, []),
           "pp2-cp2": (["parallel.pp=2", "parallel.cp=2"], 4, ["model.sliding_window=32"])}


def _host_reads(tmp_path, name: str) -> Counter:
    """Every host read of the run's ranks, by (rank, kind, call site)."""
    reads: Counter = Counter()
    for folder in tmp_path.glob(f"{name}-reports-*"):
        for report in read_reports(folder):
            if report["rank"] is not None:
                reads.update({(report["rank"], kind, site): n for kind, site, n in report["syncs"]})
    return reads


def _uploaded(tmp_path, name: str) -> Counter:
    """Bytes each rank of the run copied from host memory to the device."""
    sent: Counter = Counter()
    for folder in tmp_path.glob(f"{name}-reports-*"):
        for report in read_reports(folder):
            if report["rank"] is not None:
                sent[report["rank"]] += sum(report["uploads"].values())
    return sent


def test_document_masking_on_the_device_follows_the_cpu_run_without_new_host_reads(tmp_path):
    started = time.monotonic()
    corpus = [f"data.path={write_short_documents(tmp_path / 'short')}"]
    reference = cpu_run(tmp_path, [*corpus, *DOCUMENTS])
    for layout, (extra, world, plain) in LAYOUTS.items():
        masked = run_on_device(tmp_path, f"{layout}-documents", [*corpus, *DOCUMENTS, *extra], world=world)
        assert_parity(masked, reference, f"fakecuda {layout} documents")
        run_on_device(tmp_path, f"{layout}-plain", [*corpus, *extra, *plain], world=world)
        with_documents, without = _host_reads(tmp_path, f"{layout}-documents"), _host_reads(tmp_path, f"{layout}-plain")
        assert with_documents, f"{layout}: no host read counted at all: the counting is broken"
        assert with_documents == without, (layout, with_documents - without, without - with_documents)
        # counting the targets (data.eod_mask_loss) moved every micro-batch's inputs and targets to every
        # pipeline stage's device; each stage now uploads only what it reads (inputs on the first, targets
        # on the last), asynchronously, masked or not
        uploaded = _uploaded(tmp_path, f"{layout}-documents")
        assert all(uploaded[str(rank)] for rank in range(world)), f"{layout}: a rank uploaded nothing: {uploaded}"
        assert uploaded == _uploaded(tmp_path, f"{layout}-plain"), layout
    print(f"device document masks: {time.monotonic() - started:.1f}s")
