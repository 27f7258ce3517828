"""Document masks and sliding windows through the engines' layouts (issue 54): DeepSpeed's and
FSDP2's pipelines at pp=2, DeepSpeed's ZeRO-3 and FSDP2 at dp=2, DeepSpeed at tp=2 with sequence
parallelism, on two real gloo ranks.

The oracle shares no code with the implementation: documents of L tokens packed two to a sample of
2L tokens with data.document_mask and global batch B train to the per-step losses of the same
documents one per sample of L tokens with global batch 2B (the same tokens per step and per
micro-batch). Two blocks of three have a sliding window W < L, the third attends globally, so each
stage holds masks of both kinds, and builds each once per micro-batch (counted); the packed run also matches the one-rank run (layout invariance of
documents and windows); so do the llama's at FSDP2's V-shaped zero-bubble schedule (two stages on
a rank) and runs with windows and no documents at DeepSpeed's pp=2 (whose stages then hand the
token ids along for the masks alone) and at tp=2 with SP (each rank's masks cover the whole
sequence its SP shards gather for attention). The model is built by the engine as a run builds it (Trainer); the test
feeds the step's micro-batches itself, cut from its own documents as data/dataset.py cuts samples."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.helpers import TINY
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow
L, W, B, STEPS = 8, 3, 4, 3  # document length, window, packed global batch, steps
MODEL = ["model.num_layers=6", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
         f"model.sliding_window={W}", "model.window_attn_skip_freq=3", f"train.max_steps={STEPS}"]
FLAVOURS = {"gpt2": ["model=gpt_tiny", "data.document_mask=true"],
            "llama": ["model=llama_tiny", "data.document_mask=true", "data.eod_mask_loss=true"]}
LAYOUTS = {"deepspeed-pp2": ["parallel.pp=2", "zero=stage1"],
           "fsdp2-pp2-recompute": ["backend=fsdp2", "parallel.pp=2", "zero=stage3",
                                   "parallel.activation_checkpointing=true"],
           "deepspeed-zero3-dp2": ["zero=stage3"],
           "fsdp2-dp2": ["backend=fsdp2", "zero=stage3"],
           "deepspeed-tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "zero=stage1"]}
# (sequence length, micro-batch size, global batch size): two documents per micro-batch either way
PACKED, SINGLE = (2 * L, 1, B), (L, 2, 2 * B)


def _stream(eod: int) -> torch.Tensor:
    """2 B STEPS documents of L tokens, each ending in eod, and one token more (the last target)."""
    docs = torch.randint(0, eod, (2 * B * STEPS, L), generator=torch.Generator().manual_seed(7))
    docs[:, -1] = eod
    return torch.cat([docs.flatten(), docs[0, :1]])


def _micro_batches(stream: torch.Tensor, shape: tuple[int, int, int], step: int, dp_rank: int, dp: int) -> list:
    """This rank's micro-batches of `step`: its contiguous slice of the step's samples, in order."""
    seq, micro, batch = shape
    per_rank = batch // dp
    first = step * batch + dp_rank * per_rank
    rows = torch.stack([stream[i * seq: i * seq + seq + 1] for i in range(first, first + per_rank)])
    return [(rows[i: i + micro, :-1].clone(), rows[i: i + micro, 1:].clone()) for i in range(0, per_rank, micro)]


def _train(rank: int, world: int, runs: list[tuple[list[str], tuple[int, int, int], str]]) -> list[tuple]:
    """Each run's per-step losses, then its evaluation loss of the first step's micro-batches; and
    how many dense masks this rank built per micro-batch forward."""
    from megaframe.config.compose import compose
    from megaframe.backends.registry import validate_for_engine
    from megaframe.model.attention import Mask
    from megaframe.training.trainer import Trainer

    built, allowed = [0], Mask.allowed

    def counted(self, *args):
        built[0] += 1
        return allowed(self, *args)
    Mask.allowed = counted  # this forked rank's own class
    out = []
    for overrides, shape, run_dir in runs:
        seq, micro, batch = shape
        cfg, _ = compose([*overrides, f"model.seq_length={seq}", f"parallel.micro_batch_size={micro}",
                          f"parallel.global_batch_size={batch}"])
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
            stream = _stream(trainer.data.datasets[0].eod_id)
            dp_rank, dp = trainer.ps.dp_rank, trainer.layout.dp
            built[0] = 0
            losses = [trainer.backend.train_step(_micro_batches(stream, shape, step, dp_rank, dp)).loss
                      for step in range(STEPS)]
            losses.append(trainer.backend.eval_step(_micro_batches(stream, shape, 0, dp_rank, dp)))
        out.append((losses, built[0] / ((batch // dp // micro) * (STEPS + 1))))
    return out


def test_packed_documents_and_windows_at_pp2_dp2_and_tp2_sp_train_as_one_document_per_sample(tmp_path):
    base = {name: [*TINY, *flavour, *MODEL] for name, flavour in FLAVOURS.items()}
    windows_only = [*TINY, "model=llama_tiny", *MODEL]
    one_rank = run_ranks(_train, 1, tmp_path, runs=[(base[name], PACKED, str(tmp_path / f"{name}-one"))
                                                    for name in FLAVOURS]
                         + [(windows_only, PACKED, str(tmp_path / "windows-one"))])[0]
    runs = [([*base[name], *extra], shape, str(tmp_path / f"{name}-{layout}-{kind}"))
            for name in FLAVOURS for layout, extra in LAYOUTS.items()
            for kind, shape in (("packed", PACKED), ("single", SINGLE))]
    zbv = ["backend=fsdp2", "parallel.pp=2", "zero=stage2", "parallel.pipeline_schedule=zbv"]
    runs += [([*base["llama"], *zbv], PACKED, str(tmp_path / "llama-fsdp2-zbv")),
             ([*windows_only, *LAYOUTS["deepspeed-pp2"]], PACKED, str(tmp_path / "windows-deepspeed-pp2")),
             ([*windows_only, *LAYOUTS["deepspeed-tp2-sp"]], PACKED, str(tmp_path / "windows-deepspeed-tp2-sp"))]
    got = run_ranks(_train, 2, tmp_path, runs=runs)
    one_rank = [losses for losses, _ in one_rank]
    # every rank of the layout reports the step's global loss, and builds a stage's mask of each kind
    # once per micro-batch (a mask per block: 3 a stage, 6 a model): the window's and the documents'
    # global one; zbv's four stages hold blocks 0-1, 2-3, 4 and 5 (the first stages one more): its
    # rank 0 holds stages 0 (windowed) and 3 (global), rank 1 stages 1 (both) and 2 (windowed);
    # without documents only the windowed blocks mask
    assert [losses for losses, _ in got[1]] == [losses for losses, _ in got[0]]
    for rank, zbv in ((0, 2.0), (1, 3.0)):
        assert [builds for _, builds in got[rank]] == [*[2.0] * (len(runs) - 3), zbv, 1.0, 1.0], rank
    got = [losses for losses, _ in got[0]]
    assert got[-3] == pytest.approx(one_rank[1], rel=1e-5), "llama fsdp2 pp2 zbv"
    assert got[-2] == pytest.approx(one_rank[-1], rel=1e-5), "windows alone at deepspeed pp2"
    assert got[-1] == pytest.approx(one_rank[-1], rel=1e-5), "windows alone at deepspeed tp2 sp"
    at = iter(got)
    for name, reference in zip(FLAVOURS, one_rank):
        for layout in LAYOUTS:
            packed, single = next(at), next(at)
            what = f"{name} {layout}"
            assert packed == pytest.approx(single, rel=1e-5), f"{what}: packed {packed} vs one per sample {single}"
            assert packed == pytest.approx(reference, rel=1e-5), f"{what}: {packed} vs one rank {reference}"
