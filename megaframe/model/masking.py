"""What the attention masks of a forward are made of: documents inside a packed sample (from the
tokens and the dataset's end-of-document id) and each block's sliding window (model.sliding_window,
model.window_attn_skip_freq). The cores apply them (model/attention.py's Mask); this module only
says, per forward and per block, what they are.

Everything here is computed on the device from the token ids: no host tensor and no host read per
micro-batch (a cumulative sum and a cumulative max, the same on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megaframe.data.dataset import IGNORED_TARGET  # the loss's ignore_index (vocab_parallel_cross_entropy's)
from megaframe.model.attention import CAUSAL, Mask
from megaframe.model.dims import GPTDims
from megaframe.parallel.context import ContextGroup, gather_sequence, zigzag_shard



@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a micro-batch of token ids (B, T): `ids` numbers each token's document within
    its row, an end-of-document token belonging to the document it ends; `positions` is each token's
    place in its document (0 at each document's first token), what learned and RoPE positions read.
    Under context parallelism `ids` covers the whole row (what the cp cores mask with) and
    `positions` this rank's zig-zag shard of it (what its tokens read)."""

    ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (B, T) int64

    @property
    def length(self) -> int:
        """The tokens of a whole row: the positions the RoPE tables must cover."""
        return self.ids.shape[1]

    def rope(self, tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin rows of every token's own position from tables of positions 0..T'-1 (T' >= T):
        (B, 1, T, hs) each, broadcast over the heads."""
        cos, sin = tables
        return cos[self.positions].unsqueeze(1), sin[self.positions].unsqueeze(1)


def split_documents(idx: torch.Tensor, eod_id: int) -> Documents:
    """Documents of token ids idx (B, T) cut after each eod_id token (Megatron's reset_attention_mask
    and reset_position_ids: the end-of-document token is the last of its document)."""
    eod = idx == eod_id  # (B, T)
    ids = torch.cumsum(eod, dim=1) - eod.long()  # documents closed before each token
    starts = torch.cat([torch.ones_like(eod[:, :1]), eod[:, :-1]], dim=1)  # a document starts after an eod
    t = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)  # (B, T)
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values  # its document's first token
    return Documents(ids=ids, positions=t - first)


def documents_of(idx: torch.Tensor, dims: GPTDims, context: Optional[ContextGroup] = None) -> Optional[Documents]:
    """The documents attention keeps apart in this forward (data.document_mask), else None. Under
    context parallelism (context) idx is this rank's zig-zag shard: a document may begin on another
    cp rank, so the whole rows are gathered once per forward (one all-gather of the token ids on the
    device) and cut there."""
    if not dims.document_mask:
        return None
    if context is None or context.size == 1:
        return split_documents(idx, dims.eod_id)
    whole = split_documents(gather_sequence(idx, context), dims.eod_id)  # (B, T) on every cp rank
    return Documents(ids=whole.ids, positions=zigzag_shard(whole.positions, context.size, context.rank))


def layer_mask(dims: GPTDims, index: int) -> Mask:
    """Block `index`'s own mask: causal, with its sliding window if the pattern gives it one."""
    window = dims.window_of(index)
    return CAUSAL if window is None else Mask(window=window)


def with_documents(mask: Mask, documents: Optional[torch.Tensor]) -> Mask:
    """A block's mask for this forward: its own, restricted to the documents when there are any."""
    return mask if documents is None else Mask(causal=mask.causal, documents=documents, window=mask.window)


class ForwardMasks:
    """The masks one forward's blocks attend with: each block's own (its window) restricted to the
    forward's documents, prepared by the run's core once per distinct mask, so that blocks sharing a
    window share one dense mask (not one per block). Resolved outside the blocks (a compiled block
    takes the prepared mask as an input); `length`: the keys a query attends over."""

    def __init__(self, documents: Optional[Documents], length: int, device):
        self.documents, self.length, self.device = documents, length, device
        self._prepared: dict[tuple[bool, Optional[int]], Mask] = {}

    def resolve(self, attention) -> Mask:
        """The mask of a block's attention (its `mask` and `core`) for this forward."""
        own = attention.mask
        key = (own.causal, own.window)
        if key not in self._prepared:
            ids = None if self.documents is None else self.documents.ids
            self._prepared[key] = attention.core.prepare(with_documents(own, ids), self.length, self.device)
        return self._prepared[key]


def forward_masks(dims: GPTDims, documents: Optional[Documents], length: int, device) -> Optional[ForwardMasks]:
    """This forward's ForwardMasks, or None where every block attends plainly causally (the model
    without documents or windows keeps its path, bitwise)."""
    if documents is None and dims.sliding_window is None:
        return None
    return ForwardMasks(documents, length, device)


class StepTargets:
    """data.eod_mask_loss: a micro-batch's loss weighed so that the engine's mean over the step's
    micro-batches and its dp x cp ranks is the loss per counted target of the whole global batch, as
    Megatron-LM's --calculate-per-token-loss makes it. Each micro-batch's mean is multiplied by its
    count of targets times the step's micro-batch shares (micro-batches x dp x cp) over the global
    batch's count. Without it, each micro-batch's own mean weighed alike, and micro-batches hold
    unequal counts (the targets after an end of document are left out): the curve depended on
    parallel.micro_batch_size and parallel.dp. Set by the engine for a step or an evaluation
    (backends/common.py's counting_targets), unset (None) otherwise: a lone forward keeps its mean."""

    def __init__(self) -> None:
        # micro-batch shares over the global batch's counted targets, float64 on the device: one tensor
        # (not an int beside it), so a whole-model compile sees the same attributes in every step
        self.factor: Optional[torch.Tensor] = None

    def weigh(self, loss: torch.Tensor, targets: torch.Tensor) -> Optional[torch.Tensor]:
        """The weighed micro-batch loss, or None outside a step that counts. In float64 from exact
        counts: a micro-batch holding its equal share keeps its mean bitwise (the weight rounds to 1.0)."""
        if self.factor is None:
            return None
        counted = (targets != IGNORED_TARGET).sum()
        return loss * (counted.to(torch.float64) * self.factor).to(loss.dtype)
