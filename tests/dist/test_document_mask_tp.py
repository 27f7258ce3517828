"""data.document_mask under tensor and sequence parallelism: two real gloo ranks compute the
single rank's loss on packed documents (each TP rank finds the documents in the token ids it
holds whole; under SP the embedding's positions are taken before the sequence is split)."""
from __future__ import annotations

import torch

from megaframe.config.schema import DataConfig, ModelConfig
from megaframe.model.dims import document_dims
from megaframe.model.factory import build_model, resolve_dims
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from tests.support.ranks import run_ranks

VOCAB, EOD = 100, 99
FLAVOURS = {
    "gpt2": ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16),
    "llama": ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=16,
                         ffn_hidden_size=64, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                         tie_embeddings=False, bias=False),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, EOD, (2, 17), generator=torch.Generator().manual_seed(0))
    rows[0, [3, 9]] = EOD
    rows[1, [0, 12]] = EOD
    return rows[:, :-1], rows[:, 1:]


def _losses(rank: int, world: int, mask: bool) -> dict[str, float]:
    ps = ParallelState.build(ParallelDims(tp=world)) if world > 1 else ParallelState(ParallelDims(), rank=0)
    out = {}
    for name, cfg in FLAVOURS.items():
        dims = document_dims(resolve_dims(cfg, VOCAB, tp=world, device_type="cpu"), DataConfig(document_mask=mask, eod_mask_loss=mask),
                             EOD)
        model = build_model(dims, ps, seed=0, sequence_parallel=world > 1)
        loss = model(*_batch())
        loss.backward()
        out[name] = loss.item()
    return out


def test_document_mask_at_tp2_with_sp_is_the_single_rank_loss(tmp_path):
    single = _losses(0, 1, mask=True)
    assert single != _losses(0, 1, mask=False)  # the mask changes the loss: the comparison sees it
    for name, loss in run_ranks(_losses, 2, tmp_path, mask=True)[0].items():
        assert abs(loss - single[name]) <= 1e-5 * abs(single[name]), (name, loss, single[name])
