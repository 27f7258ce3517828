"""Cross-entropy over vocabulary-parallel logits, without ever gathering the full logits."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaframe.parallel.layers import TPGroup, at_least_fp32
from megaframe.parallel.mappings import reduce_from_tp_region


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup, vocab_start: int,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token loss over non-ignored targets; 0 (with zero gradients) where every target is.

    logits: (..., n) this rank's columns [vocab_start, vocab_start + n) of the padded vocabulary.
    Columns at or beyond vocab_size (Megatron's padding) get no probability mass.
    """
    if tp.size == 1:  # one rank holds every column: torch's fused kernel, padded columns sliced off
        logits = at_least_fp32(logits[..., :vocab_size])
        summed = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=ignore_index,
                                 reduction="sum")
        # torch's mean bitwise (it divides the same sum by the same count), but 0 where no target counts
        # (data.eod_mask_loss over a run of empty documents): torch's 0/0 would be a NaN loss and gradient
        return summed / (targets != ignore_index).sum().clamp(min=1)
    logits = at_least_fp32(logits)
    n = logits.shape[-1]
    column_ids = torch.arange(vocab_start, vocab_start + n, device=logits.device)
    logits = logits.masked_fill(column_ids >= vocab_size, float("-inf"))
    with torch.no_grad():  # the max only stabilises exp(); it cancels in the loss and its gradient
        row_max = logits.max(dim=-1).values
        if tp.size > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp.group)
    shifted = logits - row_max.unsqueeze(-1)
    sum_exp = reduce_from_tp_region(shifted.exp().sum(dim=-1), tp.group)
    local_target = targets - vocab_start
    mine = (local_target >= 0) & (local_target < n)
    target_logit = shifted.gather(-1, local_target.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tp_region(target_logit.masked_fill(~mine, 0.0), tp.group)
    losses = sum_exp.log() - target_logit
    keep = targets != ignore_index
    return losses.masked_fill(~keep, 0.0).sum() / keep.sum().clamp(min=1)
