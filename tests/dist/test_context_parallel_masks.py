"""Document and window masks under context parallelism (issue 54, item 4) on real gloo ranks.

The attention cores at cp=2 (ring, ring through its einsum pieces, Ulysses) against attention on one
process with the whole sequence's boolean mask: outputs and the gradients of q, k and v, for document
masks, windows shorter and longer than a zig-zag chunk, and both. The ring's skipped pieces are
counted against a brute-force count of the (query chunk, key chunk) pairs holding any allowed pair.

The oracle at cp=2 (it shares no code with the masks): documents of L tokens packed two to a sample
of 2L tokens with data.document_mask train, through the cp=2 model (ring and Ulysses, gpt2 and llama),
to the per-step losses of the same documents one per sample of L tokens on one process."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaframe.config.schema import DataConfig, ModelConfig
from megaframe.model.attention import Mask, build_attention_core
from megaframe.model.dims import document_dims, resolve_dims
from megaframe.model.factory import build_model
from megaframe.model.masking import split_documents
from megaframe.parallel.context import ContextGroup, zigzag_shard, zigzag_unshard
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow

EOD = 9
SEQ, C = 32, 8  # cp=2: four zig-zag chunks of 8 tokens
CASES = {"documents": (True, None), "window-3": (False, 3), "window-11": (False, 11),
         "documents-window-5": (True, 5)}


def _inputs(kv_heads: int = 2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, SEQ, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, SEQ, 8, generator=g) for _ in range(2))
    grad = torch.randn(2, 4, SEQ, 8, generator=g)
    idx = torch.randint(0, EOD, (2, SEQ), generator=g)
    idx[0, [4, 13, 20]] = EOD  # documents that cross chunk (8, 16, 24) and rank boundaries
    idx[1, [15]] = EOD
    return q, k, v, grad, split_documents(idx, EOD).ids


def _reference(documents: bool, window):
    q, k, v, grad, ids = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(SEQ)
    allowed = (pos[None, :] <= pos[:, None]) & ((pos[:, None] - pos[None, :] < window) if window else True)
    allowed = allowed[None] & (ids[:, :, None] == ids[:, None, :]) if documents else allowed[None]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=allowed[:, None])
    out.backward(grad)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def _sharded(rank: int, world: int):
    import megaframe.parallel.ring as ring

    cp = ContextGroup(group=None, ranks=tuple(range(world)), rank=rank)
    scores, original = [], ring._scores

    def counted(q, k, *args):
        scores.append((q.shape[-2], k.shape[-2]))
        return original(q, k, *args)

    ring._scores = counted
    results = {}
    for impl in ("ring", "ring-einsum", "ulysses"):
        ring.block_kernel = (lambda q: None) if impl == "ring-einsum" else block_kernel
        core = build_attention_core(0.0, None, False, cp, impl.split("-")[0])
        for case, (documents, window) in CASES.items():
            q, k, v, grad, ids = _inputs()
            q, k, v, grad = (zigzag_shard(t, world, rank, dim=2) for t in (q, k, v, grad))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            scores.clear()
            out = core(q, k, v, Mask(documents=ids if documents else None, window=window))
            forward_scores = list(scores)
            out.backward(grad)
            results[impl, case] = ([t.detach() for t in (out, q.grad, k.grad, v.grad)], forward_scores)
    return results


block_kernel = None  # set in the parent before the ranks fork: the fused kernel the ring would pick


def _nonempty_pairs(rank: int, cp: int, window) -> int:
    """Brute force: the (local query chunk, any key chunk) pairs in which some query sees some key."""
    chunks = (rank, 2 * cp - 1 - rank)
    count = 0
    for qc in chunks:
        for kc in range(2 * cp):
            count += any(0 <= i - j < (window or SEQ + 1) for i in range(qc * C, qc * C + C)
                         for j in range(kc * C, kc * C + C))
    return count


def test_cp_cores_apply_document_and_window_masks_and_skip_empty_pieces(tmp_path):
    global block_kernel
    import megaframe.parallel.ring as ring

    block_kernel = ring.block_kernel
    started = time.monotonic()
    per_rank = run_ranks(_sharded, 2, tmp_path, timeout=300)
    for case, (documents, window) in CASES.items():
        want = _reference(documents, window)
        for impl in ("ring", "ring-einsum", "ulysses"):
            shards = [per_rank[r][impl, case][0] for r in range(2)]
            for name, i in (("output", 0), ("grad q", 1), ("grad k", 2), ("grad v", 3)):
                got = zigzag_unshard([s[i] for s in shards], dim=2)
                torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-6, msg=f"{impl} {case} {name}")
            if impl == "ulysses":
                continue
            for rank in range(2):
                pieces = per_rank[rank][impl, case][1]
                # one score tile per piece here (small shapes), each a chunk of queries by a chunk of keys
                assert all(shape == (C, C) for shape in pieces), (impl, case, pieces)
                assert len(pieces) == _nonempty_pairs(rank, 2, window), (impl, case, rank, len(pieces))
    # the window shorter than a chunk skips pieces plain causal attention computes (5 per rank)
    assert [_nonempty_pairs(r, 2, 3) for r in range(2)] == [3, 4]
    assert [_nonempty_pairs(r, 2, None) for r in range(2)] == [5, 5]
    print(f"cp masks: {time.monotonic() - started:.1f}s")


# ---- the oracle at cp=2 ------------------------------------------------------------------------
VOCAB, L, B, STEPS = 40, 8, 2, 3
FLAVOURS = {
    "gpt2": ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=2 * L),
    "llama": ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=2 * L,
                         ffn_hidden_size=64, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                         tie_embeddings=False, bias=False),
}


def _stream() -> torch.Tensor:
    """2*B*STEPS documents of L tokens, each ending in EOD, then one more token (the last target)."""
    docs = torch.randint(0, VOCAB - 1, (2 * B * STEPS, L), generator=torch.Generator().manual_seed(2))
    docs[:, -1] = VOCAB - 1
    return torch.cat([docs.flatten(), docs[0, :1]])


def _samples(seq: int, first: int, count: int):
    stream = _stream()
    rows = torch.stack([stream[i * seq: i * seq + seq + 1] for i in range(first, first + count)])
    return rows[:, :-1], rows[:, 1:]


def _train(model, batches, reduce_group=None, world: int = 1) -> list[float]:
    """Per-step losses of plain AdamW; under cp the loss and the gradients are the cp ranks' mean
    (each holds an equal share of the tokens), as the engines reduce them."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for idx, targets in batches:
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=reduce_group)
                p.grad.div_(world)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=reduce_group)
            loss /= world
        opt.step()
        losses.append(loss.item())
    return losses


def _dims(cfg: ModelConfig, document_mask: bool):
    return document_dims(resolve_dims(cfg, VOCAB, device_type="cpu"), DataConfig(document_mask=document_mask),
                         VOCAB - 1)


def _packed_at_cp2(rank: int, world: int) -> dict[str, list[float]]:
    ps = ParallelState.build(ParallelDims(cp=world))
    out = {}
    for name, cfg in FLAVOURS.items():
        for impl in ("ring", "ulysses"):
            model = build_model(_dims(cfg, True), ps, seed=0, cp_impl=impl)
            batches = [tuple(zigzag_shard(t, world, rank) for t in _samples(2 * L, step * B, B)) for step in range(STEPS)]
            out[f"{name}-{impl}"] = _train(model, batches, ps.group("cp"), world)
    return out


def test_packed_documents_at_cp2_train_as_one_document_per_sample(tmp_path):
    started = time.monotonic()
    got = run_ranks(_packed_at_cp2, 2, tmp_path, timeout=300)[0]
    single_rank = ParallelState(ParallelDims(), rank=0)
    for name, cfg in FLAVOURS.items():
        # one model shape for both (seq_length 2L), so both start from the same weights; the single run
        # feeds it L tokens a sample, positions 0..L-1, as a model of seq_length L would see them
        single = _train(build_model(_dims(cfg, False), single_rank, seed=0),
                        [_samples(L, step * 2 * B, 2 * B) for step in range(STEPS)])
        for impl in ("ring", "ulysses"):
            assert got[f"{name}-{impl}"] == pytest.approx(single, rel=1e-5, abs=1e-6), (name, impl)
    print(f"cp oracle: {time.monotonic() - started:.1f}s")
