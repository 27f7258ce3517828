"""Sliding windows and document masks through the Trainer at cp=2 (the ring: Ulysses with a mask is refused
before launch, config/attention_rules.py, for its dense full-sequence mask per block) on real gloo
ranks follow the single-rank run with the same keys: every logged loss, gradient norm and eval loss
within rtol 1e-5 (tests/support/parity.py). TINY's 32 tokens make zig-zag chunks of 8 at cp=2: a
window of 5 lies inside one chunk pair (the ring skips pieces), one of 12 spans chunks. The document
runs read a corpus of short documents (tests/support/short_documents.py), so every sample holds
several and they cross chunk and rank boundaries."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.support.parity import FLAVOURS, assert_parity, train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs
from tests.support.short_documents import write_short_documents

pytestmark = pytest.mark.slow
STEPS = ["train.max_steps=4", "train.eval_interval=2"]
DOCUMENTS = ["data.document_mask=true", "data.eod_mask_loss=true"]
# name: (flavour, the masks' keys); each runs at cp=2 on the ring
MASKS = {"window5": ("llama", ["model.sliding_window=5"]),
         "window12": ("gpt2", ["model.sliding_window=12", "model.window_attn_skip_freq=2"]),
         "documents": ("gpt2", DOCUMENTS),
         "documents-window5": ("llama", [*DOCUMENTS, "model.sliding_window=5"])}
IMPLS = {"ring": ["parallel.cp=2"]}


def _config(name: str, corpus: str) -> list[str]:
    flavour, keys = MASKS[name]
    data = [f"data.path={corpus}"] if "data.document_mask=true" in keys else []
    return [*TINY, *FLAVOURS[flavour], *STEPS, *keys, *data]


def test_masked_attention_at_cp2_follows_the_single_rank_run(tmp_path_factory, tmp_path):
    started = time.monotonic()
    corpus = write_short_documents(tmp_path / "short")
    references = reference_runs({name: _config(name, corpus) for name in MASKS}, tmp_path_factory.mktemp("single"))
    runs = [([*_config(name, corpus), *extra], str(tmp_path / f"{name}-{impl}")) for name in MASKS for impl, extra in IMPLS.items()]
    run_ranks(train_runs, 2, tmp_path, timeout=900, runs=runs)
    for overrides, run_dir in runs:
        name = Path(run_dir).name.rsplit("-", 1)[0]
        assert_parity(read_metrics(run_dir), read_metrics(references[name]), Path(run_dir).name)
    print(f"cp masked training: {time.monotonic() - started:.1f}s")


# pipeline stages over cp shards: each stage cuts the documents in the rows' token ids gathered over cp;
# and over tp with sequence parallelism (Megatron's usual large layout), where each stage's SP shards
# gather the sequence its masks cover
PIPELINES = {"deepspeed-pp2-cp2": ["parallel.pp=2", "parallel.cp=2"],
             "fsdp2-pp2-cp2": ["backend=fsdp2", "zero=stage3", "parallel.pp=2", "parallel.cp=2"],
             "deepspeed-pp2-tp2-sp": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
             "fsdp2-pp2-tp2-sp": ["backend=fsdp2", "zero=stage3", "parallel.pp=2", "parallel.tp=2",
                                  "parallel.sequence_parallel=true"]}


def test_masked_attention_in_pipeline_stages_over_cp_and_tp_follows_the_single_rank_run(tmp_path_factory, tmp_path):
    """Documents with data.eod_mask_loss and a window of 5 (llama, and MoE blocks), and
    documents alone with GPT-2's tied head, through both engines' pipelines at cp=2 and at tp=2 with SP
    (world 4). pp x cp was
    refused before launch until 2026-11-30 (DeepSpeed's stages cut the documents in their own shard
    of the ids); pp x tp had not been run under masks."""
    corpus = write_short_documents(tmp_path / "short")
    configs = {name: _config(name, corpus) for name in ("documents-window5", "documents")}
    # Mixture-of-Experts blocks under the same masks: router losses attached in each stage
    configs["moe-documents-window5"] = [*TINY, "model=moe_tiny", *STEPS, *DOCUMENTS, "model.sliding_window=5",
                                        f"data.path={corpus}"]
    # torch's schedules with two stages per rank (looped, and the V), over cp: four blocks for four stages
    configs["documents-window5-4layers"] = [*configs["documents-window5"], "model.num_layers=4"]
    schedules = {"fsdp2-interleaved-pp2-cp2": [*PIPELINES["fsdp2-pp2-cp2"], "parallel.virtual_stages=2",
                                               "parallel.pipeline_schedule=interleaved_1f1b"],
                 # a split backward needs zero=stage2 (backends/fsdp2/rules.py)
                 "fsdp2-dualpipev-pp2-cp2": ["backend=fsdp2", "zero=stage2", "parallel.pp=2", "parallel.cp=2",
                                             "parallel.pipeline_schedule=dualpipev"]}
    references = reference_runs(configs, tmp_path_factory.mktemp("single"))
    runs = [([*configs[name], *extra], str(tmp_path / f"{name}@{layout}"))
            for name in configs if not name.endswith("4layers") for layout, extra in PIPELINES.items()]
    runs += [([*configs["documents-window5-4layers"], *extra], str(tmp_path / f"documents-window5-4layers@{layout}"))
             for layout, extra in schedules.items()]
    run_ranks(train_runs, 4, tmp_path, timeout=900, runs=runs)
    for _, run_dir in runs:
        name = Path(run_dir).name.split("@")[0]
        assert_parity(read_metrics(run_dir), read_metrics(references[name]), Path(run_dir).name)
