"""Mixture-of-Experts MLP: a router sends each token to top_k of E experts; the experts run as one
grouped GEMM per projection; under expert parallelism (parallel.ep) the tokens travel to the ranks
that hold their experts by all-to-all, and back.

    tokens -> router (fp32) -> sort by expert -> [all-to-all] -> experts (grouped GEMM)
           -> [all-to-all] -> unsort -> weighted sum over the k choices (+ shared experts)

Layout does not change the result: the router is a function of the token alone, every expert's
initial value comes from its place in the full (E, ...) tensor, and dropless routing computes
every assignment whichever rank holds the expert. Under tensor parallelism the tokens are split
over the TP ranks for the routed part (experts are not TP-split: each TP rank routes 1/tp of the
tokens), so expert and router gradients are summed over TP like any replicated weight.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megaframe.common.compile_breaks import run_eagerly
from megaframe.model.dims import GPTDims, MoEDims, capacity_slots
from megaframe.model.mlp import MLP, Dropout, gelu
from megaframe.model.recompute import recomputing
from megaframe.parallel.experts import ExpertGroup, mark_expert_shard
from megaframe.parallel.layers import TPGroup, at_least_fp32
from megaframe.parallel.matmul import MatmulSite
from megaframe.parallel.mappings import all_to_all_rows, gather_tokens, split_tokens


# the GPUs (compute capability majors) whose grouped GEMM kernel torch builds: Hopper and datacenter
# Blackwell. torch accepts bf16 from sm80, but there (and on other majors) it runs its fallback, which
# reads the group offsets to the host at every grouped GEMM: about 9 reads a layer and micro-batch
# (3 forward, 6 backward), where megaframe's own loop reads the counts once a layer
_GROUPED_MM_MAJORS = (9, 10)


def _grouped_mm_works(x: torch.Tensor, *widths: int) -> bool:
    """Whether torch's grouped GEMM runs as one kernel for inputs like x and weights `widths` (in and
    out features): on the CPU in fp32, bf16 and fp16 (not fp64); on CUDA in bf16 on sm90 and sm100
    (_GROUPED_MM_MAJORS); on both with every width a multiple of 16 bytes, as torch requires of the
    operands' strides (an expert width of 34 in fp32 was "strides should be multiple of 16 bytes" at
    step 0 on the CPU). Where it does not, the experts take the loop (one host read of the counts per
    layer, none under a capacity factor)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(width * x.element_size() % 16 == 0 for width in (x.shape[-1], *widths))
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and aligned
            and torch.cuda.get_device_capability(x.device)[0] in _GROUPED_MM_MAJORS)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   host_counts: Optional[list[int]] = None, site: MatmulSite = TPGroup().site("experts")) -> torch.Tensor:
    """Rows of x grouped by expert (counts[g] rows for expert g, in order) times each expert's
    (out, in) weight: (M, in) -> (M, out), one grouped GEMM. Where torch has none for this device
    and dtype, a loop over the experts, which needs the row counts on the host (host_counts: read
    once by the caller for all its projections). Both compute through `site`, the matmul seam."""
    if _grouped_mm_works(x, *weight.shape[-2:]):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return site.grouped_mm(x, weight, offsets)
    pieces = torch.split(x, counts.tolist() if host_counts is None else host_counts)
    return torch.cat([site.linear(piece, w) for piece, w in zip(pieces, weight)])


class Router(nn.Module):
    """Scores experts for each token in fp32 (softmax or sigmoid) and picks the top k; the k
    weights are renormalised to sum to 1 when norm_topk_prob. With bias balancing (DeepSeek-V3's
    aux-loss-free method) a per-expert bias shifts which experts are picked, not their weights."""

    def __init__(self, dims: GPTDims, tp: TPGroup):
        super().__init__()
        moe = dims.moe
        self.tp, self.moe = tp, moe
        self.matmul = tp.site("router")
        self.weight = nn.Parameter(torch.empty(moe.num_experts, dims.hidden_size))
        # not persistent: checkpoints keep it in their state (router_biases), whole on every layout
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if moe.bias_update_rate else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) -> logits (N, E) fp32, scores (N, E) fp32, top_idx (N, k), top_weights (N, k) fp32."""
        # the tokens here are this TP rank's share: the weight's gradient is summed over TP
        logits = self.matmul.linear(at_least_fp32(x), at_least_fp32(self.tp.sync_grad(self.weight, on_shards=True)))
        scores = torch.softmax(logits, dim=-1) if self.moe.router_score == "softmax" else torch.sigmoid(logits)
        choose_by = scores if self.expert_bias is None else scores + self.expert_bias
        top_idx = torch.topk(choose_by, self.moe.top_k, dim=-1, sorted=False).indices
        top_weights = scores.gather(-1, top_idx)
        if self.moe.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(-1, keepdim=True)
        return logits, scores, top_idx, top_weights


class Experts(nn.Module):
    """This rank's experts, their weights stacked as (E_local, out, in) tensors (one grouped GEMM
    per projection): SwiGLU (gate, up, down) or GELU (up, down), no biases."""

    def __init__(self, dims: GPTDims, tp: TPGroup, ep: ExpertGroup):
        super().__init__()
        moe = dims.moe
        self.tp = tp
        self.matmul = tp.site("experts")
        self.activation = dims.activation
        self.swiglu = dims.activation == "swiglu"
        local, h, f = moe.num_experts // ep.size, dims.hidden_size, moe.ffn_hidden_size
        self.hidden, self.ffn = h, f

        def stacked(out_features: int, in_features: int) -> nn.Parameter:
            param = nn.Parameter(torch.empty(local, out_features, in_features))
            return mark_expert_shard(param, (moe.num_experts, out_features, in_features), ep)
        self.gate_proj = stacked(f, h) if self.swiglu else None
        self.up_proj = stacked(f, h)
        self.down_proj = stacked(h, f)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, host_counts: Optional[list[int]] = None) -> torch.Tensor:
        """x (M, C) grouped by local expert, counts (E_local,) rows per expert -> (M, C); host_counts:
        the same counts where the caller knows them on the host (a capacity's fixed slots)."""
        w = self._summed_over_tp
        # without a grouped GEMM (fp32/fp16 on CUDA, bf16 before Hopper or misaligned widths) the loop over
        # experts reads the counts to the host: once per layer and micro-batch, as Megatron's SequentialMLP does
        host = None if _grouped_mm_works(x, self.hidden, self.ffn) else \
            host_counts if host_counts is not None else counts.tolist()
        up = grouped_linear(x, w(self.up_proj), counts, host, self.matmul)
        if self.swiglu:
            hidden = F.silu(grouped_linear(x, w(self.gate_proj), counts, host, self.matmul)) * up
        else:
            hidden = gelu(up, self.activation)
        return grouped_linear(hidden, w(self.down_proj), counts, host, self.matmul)

    def _summed_over_tp(self, param: nn.Parameter) -> torch.Tensor:
        # each TP rank routes 1/tp of the tokens: an expert's gradient is the sum over TP ranks
        return self.tp.sync_grad(param, on_shards=True)


def expert_counts(top_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, (E,) int64, without a host read: CUDA's bincount reads the indices'
    min and max to the host to size its output, which stalls the stream per layer and micro-batch."""
    flat = top_idx.flatten()
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


class MoE(nn.Module):
    """The routed MLP of a block (plus shared experts, which every token goes through)."""

    def __init__(self, dims: GPTDims, tp: TPGroup, rng=None, ep: ExpertGroup = ExpertGroup(), context=None):
        super().__init__()
        moe = dims.moe
        self.moe, self.tp, self.ep = moe, tp, ep
        self.cp_group = None if context is None else context.group
        self.cp = 1 if context is None else context.size
        self.router = Router(dims, tp)
        self.experts = Experts(dims, tp, ep)
        self.shared = None
        if moe.shared_experts:
            shared_dims = dataclasses.replace(dims, ffn_hidden_size=moe.shared_experts * moe.ffn_hidden_size)
            self.shared = MLP(shared_dims, tp, rng)
        self.dropout = Dropout(dims.dropout, rng, split_across_tp=tp.sequence_parallel)
        self.aux_loss: Optional[torch.Tensor] = None  # what this layer adds to the loss, with its graph
        self.stats: dict[str, torch.Tensor] = {}  # detached, for metrics
        self.step_counts: Optional[torch.Tensor] = None  # bias balancing: this rank's assignments this step
        self.row = 0  # which of the model's MoE blocks this is (Block sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C), replicated over TP (or, under SP, this rank's sequence shard) -> same shape."""
        y = self.dropout(self._routed(x))
        return y if self.shared is None else y + self.shared(x)

    # Under train.compile the block around it compiles and this runs eagerly: its shapes depend on
    # the routing (and the grouped GEMM has no fp32 kernel for inductor's fake tensors).
    @run_eagerly
    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        if not self.tp.sequence_parallel:
            tokens = split_tokens(tokens, self.tp.group)  # each TP rank routes 1/tp of the tokens
        logits, scores, top_idx, top_weights = self.router(tokens)
        counts = expert_counts(top_idx, self.moe.num_experts)
        aux_loss, stats = self._router_losses(logits, scores, counts)
        if not recomputing():  # the forward's records stand; the recomputation's would leak its graph
            self.aux_loss, self.stats = aux_loss, stats
            if self.router.expert_bias is not None and self.training:
                self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        routed = self._dispatch_compute_combine(tokens, top_idx, top_weights, counts)
        if not self.tp.sequence_parallel:
            routed = gather_tokens(routed, self.tp.group)
        return routed.view(shape)

    # ---- losses -------------------------------------------------------------------------------
    def _router_losses(self, logits: torch.Tensor, scores: torch.Tensor,
                       counts: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The load-balancing loss (coeff * E * sum_i f_i * P_i: f_i the share of assignments to
        expert i, P_i its mean probability) and the z-loss (coeff * mean logsumexp(logits)^2), over
        the micro-batch's tokens, which TP and CP ranks hold in parts.

        The counts are summed over those ranks (no gradient flows through them); each rank adds
        its own tokens' part of the sum over tokens, times cp: CP ranks' gradients are averaged,
        TP ranks' summed (the router weight is a replicated parameter used on split tokens)."""
        moe = self.moe
        global_counts = counts.detach().to(scores.dtype)  # fp32, or fp64 in a float64 model
        split = self.tp.size * self.cp
        for group, size in ((self.tp.group, self.tp.size), (self.cp_group, self.cp)):
            if size > 1:
                dist.all_reduce(global_counts, group=group)
        tokens = logits.shape[0] * split
        probs = scores if moe.router_score == "softmax" else scores / scores.sum(-1, keepdim=True)
        share = global_counts / (tokens * moe.top_k)
        aux = moe.aux_loss_coeff * moe.num_experts * (share * probs.sum(0)).sum() / tokens
        z = moe.z_loss_coeff * torch.logsumexp(logits, dim=-1).pow(2).sum() / tokens
        stats = {"aux_loss": aux.detach() * self.cp, "z_loss": z.detach() * self.cp, "counts": global_counts}
        return (aux + z) * self.cp, stats

    # ---- tokens to experts and back -------------------------------------------------------------
    def _dispatch_compute_combine(self, tokens: torch.Tensor, top_idx: torch.Tensor, top_weights: torch.Tensor,
                                  counts: torch.Tensor) -> torch.Tensor:
        n, k = top_idx.shape
        flat = top_idx.flatten()
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within
        sent = tokens.index_select(0, order // k)  # (n*k, C)
        if self.moe.capacity_factor is None:
            out = self._dropless(sent, counts)
            dropped = counts.new_zeros((), dtype=torch.float32)
        else:
            out, dropped = self._with_capacity(sent, flat.index_select(0, order), counts)
        if not recomputing():
            self.stats["dropped"] = dropped
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = out.index_select(0, inverse).view(n, k, -1)  # back in (token, choice) order
        # a fixed summation order over the k choices: the same sum on every layout
        return (out * top_weights.unsqueeze(-1).to(out.dtype)).sum(1)

    def _dropless(self, sent: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        if ep.size == 1:
            return self.experts(sent, counts)
        local = self.moe.num_experts // ep.size
        by_rank = counts.view(ep.size, local)
        received_counts = torch.empty_like(by_rank)
        dist.all_to_all_single(received_counts, by_rank, group=ep.group)  # [source rank, my expert]
        # the all-to-all's row counts must be on the host: one read per layer and micro-batch (as
        # Megatron's dropless dispatcher); capacity_factor avoids it with fixed-size buffers
        splits = torch.stack([by_rank.sum(1), received_counts.sum(1)]).tolist()
        send_splits, receive_splits = splits
        received = all_to_all_rows(sent, receive_splits, send_splits, ep.group)
        expert_major = _expert_major_order(received_counts, sum(receive_splits))
        computed = self.experts(received.index_select(0, expert_major), received_counts.sum(0))
        back = torch.empty_like(expert_major)
        back[expert_major] = torch.arange(expert_major.numel(), device=expert_major.device)
        return all_to_all_rows(computed.index_select(0, back), send_splits, receive_splits, ep.group)

    def _with_capacity(self, sent: torch.Tensor, expert_of: torch.Tensor,
                       counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert takes at most `capacity` of this rank's assignments (the first in token
        order); the rest are dropped (their output is 0), and their number is returned with the
        outputs. Fixed-size buffers: no host read."""
        moe, ep = self.moe, self.ep
        rows, width = sent.shape
        capacity = capacity_slots(rows // moe.top_k, moe.top_k, moe.num_experts, moe.capacity_factor)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(rows, device=sent.device) - starts.index_select(0, expert_of)
        kept = position < capacity
        slot = torch.where(kept, expert_of * capacity + position, moe.num_experts * capacity)  # dropped -> spare row
        buffer = sent.new_zeros(moe.num_experts * capacity + 1, width).index_copy(0, slot, sent)[:-1]
        local = moe.num_experts // ep.size
        received = all_to_all_rows(buffer, None, None, ep.group)  # [source rank][my expert][slot]
        by_expert = received.view(ep.size, local, capacity, width).transpose(0, 1).reshape(-1, width)
        slots = torch.full((local,), ep.size * capacity, dtype=counts.dtype, device=counts.device)
        computed = self.experts(by_expert, slots, [ep.size * capacity] * local)  # known here: no read
        computed = computed.view(local, ep.size, capacity, width).transpose(0, 1).reshape(-1, width)
        returned = all_to_all_rows(computed, None, None, ep.group)
        returned = torch.cat([returned, returned.new_zeros(1, width)])
        return returned.index_select(0, slot), (~kept).sum().float()


def _expert_major_order(received_counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Row indices that reorder received rows from [source rank][expert] blocks to [expert][source]."""
    sources, local = received_counts.shape
    flat = received_counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view(sources, local).t().flatten()  # block starts, expert-major
    sizes = received_counts.t().flatten()
    new_starts = torch.cumsum(sizes, 0) - sizes
    shift = torch.repeat_interleave(starts - new_starts, sizes, output_size=rows)
    return torch.arange(rows, device=received_counts.device) + shift


def _by_row(layers: list[MoE], rows: int, value) -> torch.Tensor:
    """(rows, E): value(layer) at each layer's row (its place among the model's MoE blocks), zeros
    elsewhere: under a pipeline a stage fills its own rows, and a sum over stages fills them all."""
    table = None
    for layer in layers:
        v = value(layer)
        if table is None:
            table = v.new_zeros(rows, v.numel())
        table[layer.row] = v
    return table


@torch.no_grad()
def _balancing_table(moe: Optional[MoEDims], rows: int, device) -> Optional[torch.Tensor]:
    """(rows, E) zeros when the model balances its experts by bias, else None: decided by the config,
    not by the layers a pipeline stage holds, so a stage with no MoE layer (model.moe.first_dense_layers
    under pp) still joins the all-reduce its peers enter (else they wait for it until the timeout)."""
    if moe is None or not moe.bias_update_rate or rows == 0:
        return None
    return torch.zeros(rows, moe.num_experts, device=device)


def update_expert_biases(layers: list[MoE], rows: int, moe: Optional[MoEDims], device,
                         apply: bool = True) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): after each step, every routed layer's bias moves
    bias_update_rate towards the experts that took fewer than the mean of the step's assignments,
    counted over all ranks (one all-reduce for all layers), so every rank keeps the same biases."""
    counts = _balancing_table(moe, rows, device)
    if counts is None:
        return
    balanced = [layer for layer in layers if layer.router.expert_bias is not None and layer.step_counts is not None]
    if apply:
        for layer in balanced:
            counts[layer.row] = layer.step_counts.float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)  # every pipeline stage joins, each with its own rows filled
        for layer in balanced:
            load = counts[layer.row]
            layer.router.expert_bias += layer.moe.bias_update_rate * torch.sign(load.mean() - load)
    for layer in balanced:  # a skipped step's routing moves no bias
        layer.step_counts = None


def router_biases(layers: list[MoE], rows: int, moe: Optional[MoEDims], device,
                  pp_group=None) -> dict[str, list[float]]:
    """The balancing biases by MoE row, whole, for a checkpoint's state (every rank calls it: the
    pipeline stages pool their rows, a stage without MoE layers with zeros; a host read, at saves only)."""
    table = _balancing_table(moe, rows, device)
    if table is None:
        return {}
    for layer in layers:
        if layer.router.expert_bias is not None:
            table[layer.row] = layer.router.expert_bias.float()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(table, group=pp_group)
    return {str(row): values for row, values in enumerate(table.tolist())}


def load_router_biases(layers: list[MoE], saved: dict[str, list[float]]) -> None:
    for layer in layers:
        if layer.router.expert_bias is not None and str(layer.row) in saved:
            layer.router.expert_bias.copy_(torch.tensor(saved[str(layer.row)]))


class RouterStats:
    """Router metrics summed on the device over the micro-batches since the last log step; read
    (one collective, one host read) when a metrics line is written. Rows: the model's MoE blocks
    (a pipeline stage fills its own)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.sums: Optional[torch.Tensor] = None  # [aux, z, dropped, assignments]
        self.counts: Optional[torch.Tensor] = None  # (rows, E) assignments per expert
        self.layer_forwards = 0  # on the host: no tensor made per micro-batch

    def add(self, layers: list[MoE]) -> None:
        stats = [layer.stats for layer in layers]
        sums = torch.stack([sum(s["aux_loss"] for s in stats), sum(s["z_loss"] for s in stats),
                            sum(s["dropped"] for s in stats), sum(s["counts"].sum() for s in stats)])
        counts = _by_row(layers, self.rows, lambda layer: layer.stats["counts"])
        if self.sums is None:
            self.sums, self.counts = sums, counts
        else:
            self.sums, self.counts = self.sums + sums, self.counts + counts
        self.layer_forwards += len(layers)

    def reset(self) -> None:
        self.sums, self.counts, self.layer_forwards = None, None, 0


class AttachAux(torch.autograd.Function):
    """x -> x in value; in backward the router losses get `scale` as their gradient (Megatron's
    auxiliary-loss scaler). For pipeline stages, where the loss is elsewhere: scale is what
    DeepSpeed's pipeline multiplies each micro-batch's loss by, 1/accumulation steps."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        # x's storage, not a view of x: FSDP2 warns of a stage that returns a view (an in-place op on
        # it would skip the stage's pre-backward hook); the shared version counter still guards x
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class AddAux(torch.autograd.Function):
    """loss -> loss in value; in backward the router losses get the loss's gradient too (whatever
    scale DeepSpeed gave it: 1/accumulation, the fp16 loss scale), so they train with the model
    while the reported loss stays the language-model loss."""

    @staticmethod
    def forward(ctx, loss, aux):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad
