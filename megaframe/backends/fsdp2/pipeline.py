"""Pipeline parallelism for backend=fsdp2 through torch.distributed.pipelining.

The model is built whole on the meta device (no memory) and cut into S = pp x virtual_stages stages
of whole blocks, each stage a module that holds its layers under their canonical names (embed.*,
blocks.{i}.*, final_norm.*, head.*), so checkpoints, initial values and the gradient norm are those
of the unpipelined model. Each stage is sharded with fully_shard like the whole model is without
pipelining (one group per block, the stage itself the root) and run by one of torch's schedules:

  gpipe             all forwards, then all backwards (one stage per rank)
  1f1b              one forward, one backward in the steady state (one stage per rank)
  interleaved_1f1b  Megatron's interleaving: virtual_stages stages per rank, looped (rank r holds
                    stages r, r + pp, ...); the bubble shrinks by that factor
  zero_bubble       interleaved, with each backward split into its input and weight halves, the
                    weight halves filling the bubble
  zbv, dualpipev    two stages per rank in a V (rank r holds stages r and 2pp-1-r), zero-bubble
                    and DualPipe's overlapped forward/backward pairs

Stages pass only hidden states (B, T/cp[/tp under SP], C), declared to torch up front: no shape
inference runs a real forward (which would draw dropout masks twice). Under data.document_mask each
stage also takes the micro-batch's token ids, which every rank loads: torch hands a step's keyword
arguments, cut into micro-batches, to every stage, so each finds the documents on its own device,
with nothing sent between stages. A tied embedding (GPT-2) is
held by the first stage and, as a copy starting from the same value, by the last, which uses it as
the LM head; after each backward the two gradients are summed, so both copies take the same
update and stay equal (DeepSpeed's pipeline does the same with its TiedLayerSpec). The copy on
the last stage is counted once in the gradient norm and written once in checkpoints. A
Mixture-of-Experts block's router losses cannot join the loss, which only the last stage has: each
stage attaches its blocks' losses to its output (AttachAux), so they train through the gradient
torch's schedule gives each micro-batch's loss, as DeepSpeed's pipeline does (backends/deepspeed/pipeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules

from megaframe.model.dims import GPTDims
from megaframe.model.factory import layer_parameters
from megaframe.model.gpt import GPT, forward_layers
from megaframe.model.moe import AttachAux, MoE
from megaframe.parallel.cross_entropy import vocab_parallel_cross_entropy
from megaframe.parallel.layers import VocabParallelEmbedding
from megaframe.parallel.pipeline_schedules import (ONE_STAGE_PER_RANK, V_SHAPED, partition_balanced, stage_indices,
                                                   stages_per_rank, uniform_cuts)
from megaframe.parallel.state import ParallelState

# parallel.pipeline_schedule -> torch's schedule (which stages sit on which rank: parallel/pipeline_schedules.py)
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                   "zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}


def block_ranges(model: GPT, num_stages: int, partition: str = "uniform") -> list[range]:
    """Blocks of each stage; the embedding rides on the first stage and the final norm and head on
    the last. uniform: as even as whole blocks allow (Megatron's uniform split); parameters:
    DeepSpeed's balanced partition of each layer's parameters on this rank, as the planner cuts it
    (plan/memory.py), so the stages holding the embedding and a large-vocabulary head take fewer
    blocks (Megatron's --account-for-embedding-in-pipeline-split)."""
    n = model.dims.num_layers
    if partition == "uniform":
        cuts = uniform_cuts(n, num_stages)
        return [range(cuts[i], cuts[i + 1]) for i in range(num_stages)]
    parts = partition_balanced(layer_parameters(model), num_stages)  # embed | blocks | final norm | head
    # a head heavier than a stage's share left alone on the last stage: its final norm goes with it
    # (a stage passes hidden states or logits on; the planner counts one norm less there)
    parts[-2] = min(parts[-2], n + 1)
    ranges = [range(max(start - 1, 0), min(stop - 1, n)) for start, stop in zip(parts, parts[1:])]  # block i: layer i+1
    if any(not blocks for blocks in ranges[1:-1]):  # not with fewer stages than blocks (rules.py)
        raise ValueError(f"parallel.pipeline_partition={partition}: a middle stage without a block ({parts})")
    return ranges


class TiedHead(nn.Module):
    """The last stage's copy of a tied token embedding, used as the LM head; named `embed` in its
    stage, so its parameter is embed.tok.weight like the first stage's."""

    def __init__(self, tok: nn.Module, tp):
        super().__init__()
        self.tok, self.tp = tok, tp
        self.head_matmul = tp.site("head")  # the tied head computes through the matmul seam, as GPT's does


class Stage(nn.Module):
    """Stage `index` of `num_stages`: the first embeds token ids, the last returns this TP rank's
    slice of the padded-vocabulary logits; each runs its blocks in between, as GPT.parallel_logits
    does for the whole model."""

    def __init__(self, model: GPT, index: int, num_stages: int, blocks: range):
        super().__init__()
        self.dims, self.rng = model.dims, model.rng
        self.activation_checkpointing = model.activation_checkpointing
        self.num_stages = num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.context = model.context  # context parallelism: documents are cut in the whole rows
        if model.positions is not None:  # context parallelism: this rank's zig-zag positions
            self.register_buffer("positions", model.positions.clone(), persistent=False)
        else:
            self.positions = None
        self.rope = model.rope
        self.embed: Optional[nn.Module] = None
        if self.first:
            self.embed = model.embed
        elif self.last and model.head is None:  # built anew (inside parameters_on_meta): a second parameter
            tp = model.embed.tp
            self.embed = TiedHead(VocabParallelEmbedding(model.dims.padded_vocab_size, model.dims.hidden_size, tp), tp)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.final_norm = model.final_norm if self.last else None
        self.head = model.head if self.last else None
        # not a ModuleList: no new names. The model's RouterStats: each stage fills its own blocks' rows
        self.moe_layers = [block.mlp for block in self.blocks.values() if isinstance(block.mlp, MoE)]
        self.router_stats = model.router_stats

    def forward(self, x: torch.Tensor, token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """token_ids: the micro-batch's (B, T), where a later stage needs them (data.document_mask)."""
        tokens = len(self.positions) if self.positions is not None else self.dims.seq_length
        x = forward_layers(self, x, tokens, self.blocks.values(), embed=self.embed if self.first else None,
                           final_norm=self.final_norm, head=self.head, tied=self.embed, token_ids=token_ids)
        if self.moe_layers and self.training:
            self.router_stats.add(self.moe_layers)
            # gradient 1, as the schedule gives each micro-batch's loss (it divides every gradient by
            # the micro-batches after the backward: scale_grads, build_pipeline)
            x = AttachAux.apply(x, sum(layer.aux_loss for layer in self.moe_layers), 1.0)
        return x


class RankStages:
    """The stages one rank runs, seen as one model by what walks a rank's parameters (the
    optimizer, the gradient norm, checkpoints, held-state accounting): canonical names, stage by
    stage. A tied embedding on a V-shaped rank appears twice under one name (first and last stage)."""

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self.rng = stages[0].rng  # the stages share the model's TP dropout stream (checkpointed with the run)
        # as GPT's: what the router metrics, bias balancing and checkpoints read (backends/common.py)
        self.moe_layers = [layer for stage in stages for layer in stage.moe_layers]
        self.router_stats = stages[0].router_stats

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for stage in self.stages:
            yield from stage.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def modules(self) -> Iterator[nn.Module]:
        for stage in self.stages:
            yield from stage.modules()

    def train(self, mode: bool = True) -> "RankStages":
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> "RankStages":
        return self.train(False)

    def register_forward_hook(self, hook: Callable) -> "_Handles":
        """The hook on every stage's output (a fault injected through this rank's activations)."""
        return _Handles([stage.register_forward_hook(hook) for stage in self.stages])


@dataclass
class _Handles:
    handles: list

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def cut_stages(model: GPT, ps: ParallelState, schedule: str, virtual_stages: int,
               partition: str = "uniform") -> dict[int, Stage]:
    """This rank's stages of a GPT built on the meta device, by stage index."""
    num_stages = ps.pp * stages_per_rank(schedule, virtual_stages)
    ranges = block_ranges(model, num_stages, partition)
    return {i: Stage(model, i, num_stages, ranges[i])
            for i in stage_indices(schedule, ps.pp, virtual_stages, ps.pp_rank)}


def tied_copies(stages: dict[int, Stage]) -> list[nn.Parameter]:
    """The last stage's copy of a tied embedding, if this rank holds it (the first stage counts and
    writes the embedding; the copy is skipped by the norm and by checkpoint writes)."""
    return [stage.embed.tok.weight for stage in stages.values() if isinstance(stage.embed, TiedHead)]


def embedding_groups(ps: ParallelState, schedule: str, tied: bool) -> Optional[object]:
    """The two-rank group (first and last pipeline rank, same dp/cp/tp place) over which a tied
    embedding's two gradients are summed; None when no such group is needed (untied, or V-shaped:
    rank 0 holds both ends). Collective over the world: every rank creates every group."""
    if not tied or schedule in V_SHAPED:
        return None
    mine = None
    for ranks in ps.grid.groups("pp"):
        ends = [ranks[0], ranks[-1]]
        group = dist.new_group(ends)
        if ps.rank in ends:
            mine = group
    return mine


@dataclass
class Pipeline:
    """A rank's stages and the schedule that runs them (one step: all micro-batches of a batch)."""

    stages: dict[int, Stage]
    schedule: schedules._PipelineSchedule
    pp_group: object
    pp_group_ranks: list[int]  # global ranks of this pipeline, by pipeline rank
    pp_rank: int
    stage_ranks: list[int]  # the pipeline rank that runs each stage
    hidden: torch.Tensor  # (meta) what stages pass to each other
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the schedule's too
    device: torch.device
    embedding_group: Optional[object] = None
    needs_token_ids: bool = False  # every stage takes the micro-batch's token ids (data.document_mask)
    has_first: bool = field(init=False)
    has_last: bool = field(init=False)

    def __post_init__(self) -> None:
        self.has_first = any(stage.first for stage in self.stages.values())
        self.has_last = any(stage.last for stage in self.stages.values())
        self.num_stages = len(self.stage_ranks)

    def train(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (the schedule splits the batch);
        returns the sum of their losses, a 0-d fp64 tensor equal on every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        if self.needs_token_ids:  # cut into micro-batches, to every stage of this rank
            kwargs["token_ids"] = inputs
        self.schedule.step(*args, return_outputs=False, **kwargs)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.detach()
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds the losses
        return total

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward only, micro-batch by micro-batch through the stages in order, each rank running
        its own and passing hidden states on; the sum of the losses, equal on every pipeline rank.
        torch's schedules keep their backward actions in eval mode (zbv and dualpipev fail on
        them, torch 2.13), and evaluation is rare enough that a bubble costs little."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        last = self.num_stages - 1
        for inputs, targets in batches:
            x = inputs
            for index in range(self.num_stages):
                owner = self.stage_ranks[index]
                if owner != self.pp_rank:
                    continue
                if index > 0 and self.stage_ranks[index - 1] != owner:
                    x = torch.empty(self.hidden.shape, dtype=self.hidden.dtype, device=self.device)
                    dist.recv(x, src=self.pp_group_ranks[self.stage_ranks[index - 1]], group=self.pp_group)
                x = self.stages[index](x, token_ids=inputs) if self.needs_token_ids else self.stages[index](x)
                if index == last:
                    total += self.loss_fn(x, targets).detach()
                elif self.stage_ranks[index + 1] != owner:
                    dist.send(x.contiguous(), dst=self.pp_group_ranks[self.stage_ranks[index + 1]], group=self.pp_group)
        dist.all_reduce(total, group=self.pp_group)
        return total

    def sum_tied_gradients(self) -> None:
        """embed.tok.weight's gradients of the first and the last stage, summed into both (the
        embedding's use plus the head's); their local shards line up: same shape, same mesh."""
        ends = [s.embed.tok.weight for s in self.stages.values() if s.first or isinstance(s.embed, TiedHead)]
        grads = [_local(p.grad) for p in ends if p.grad is not None]
        if len(ends) == 2:  # V-shaped: both ends on this rank
            if len(grads) == 2:
                grads[0].add_(grads[1])
                grads[1].copy_(grads[0])
            return
        if self.embedding_group is None or not grads:
            return
        grad = grads[0]
        summed = grad.to(self.device)  # NCCL reduces device tensors: an offloaded gradient goes over
        dist.all_reduce(summed, group=self.embedding_group)
        if summed is not grad:
            grad.copy_(summed)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def loss_function(model: GPT) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy over this TP rank's vocabulary shard of the last stage's logits, weighed as the
    model's StepTargets says in a step with data.eod_mask_loss (the engine sets it)."""
    tp, vocab_start, vocab_size = model.embed.tp, model.embed.tok.vocab_start, model.dims.vocab_size
    step_targets = model.step_targets

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # targets data.eod_mask_loss leaves out come as IGNORED_TARGET (data/dataset.py windows_batch)
        mean = vocab_parallel_cross_entropy(logits, targets, tp, vocab_start, vocab_size)
        weighed = step_targets.weigh(mean, targets)
        return mean if weighed is None else weighed
    return loss


def stage_shapes(dims: GPTDims, ps: ParallelState, micro_batch_size: int, sequence_parallel: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Meta tensors of what stages pass: token ids into the first, hidden states between stages,
    vocabulary-shard logits out of the last."""
    tokens = dims.seq_length // ps.cp
    rows = tokens // ps.tp if sequence_parallel and ps.tp > 1 else tokens
    meta = torch.device("meta")
    # hidden states carry gradients back to the stage before: torch sizes its receive buffers
    # (and whether they require grad) from these
    return (torch.empty(micro_batch_size, tokens, dtype=torch.long, device=meta),
            torch.empty(micro_batch_size, rows, dims.hidden_size, dtype=dtype, device=meta, requires_grad=True),
            torch.empty(micro_batch_size, tokens, dims.padded_vocab_size // ps.tp, dtype=dtype, device=meta,
                        requires_grad=True))


def build_pipeline(stages: dict[int, Stage], model: GPT, ps: ParallelState, schedule: str, n_microbatches: int,
                   micro_batch_size: int, sequence_parallel: bool, dtype: torch.dtype, device: torch.device,
                   embedding_group: Optional[object]) -> Pipeline:
    """torch's PipelineStage for each of this rank's (sharded, materialised) stages, and the schedule."""
    tokens, hidden, logits = stage_shapes(model.dims, ps, micro_batch_size, sequence_parallel, dtype)
    pipeline_stages = []
    for index, stage in sorted(stages.items()):
        num_stages = stage.num_stages
        pipeline_stages.append(PipelineStage(
            stage, index, num_stages, device, group=ps.pp_group,
            input_args=tokens if index == 0 else hidden,
            output_args=logits if index == num_stages - 1 else hidden))
    cls, loss_fn = getattr(schedules, TORCH_SCHEDULES[schedule]), loss_function(model)
    runner = cls(pipeline_stages[0] if schedule in ONE_STAGE_PER_RANK else pipeline_stages, n_microbatches,
                 loss_fn=loss_fn, scale_grads=True)
    stage_ranks = [next(r for r in range(ps.pp) if i in stage_indices(schedule, ps.pp, len(stages), r))
                   for i in range(num_stages)]
    return Pipeline(stages, runner, ps.pp_group, ps.group_ranks("pp"), ps.pp_rank, stage_ranks, hidden, loss_fn,
                    device, embedding_group, needs_token_ids=model.dims.document_mask)
