"""Muon (Newton-Schulz-orthogonalised momentum) for the hidden matrices, torch's AdamW for the rest,
as one torch optimizer: one set of param groups for the LR schedule, one state table by parameter.

The matrices' step is torch.optim.Muon's (torch 2.13), operation for operation: the momentum buffer
as a lerp towards the gradient, Nesterov's look-ahead, five quintic Newton-Schulz iterations in bf16
on the matrix transposed to be wide, decoupled weight decay, then the update at the learning rate
scaled by the matrix's shape (adjust_lr). Unlike torch's, a 3D parameter is a stack of matrices
(a MoE layer's experts, E x rows x cols), each orthogonalised on its own in one batched iteration.
The AdamW groups are stepped by a torch.optim.AdamW that shares these groups and this state.

Newton-Schulz needs the whole matrix: a matrix is whole on this rank (one rank, a mesh of one, an
expert stack split by experts), or split over ranks (FSDP2's shards, tensor parallelism's pieces,
both: pieces.py), or cut into flat ranges of a partition an engine steps as one tensor (DeepSpeed
ZeRO's ranges of whole matrices or of TP pieces, which the engine describes through
partition_flat()), and assembled on one owner among them
(sharded.py). The config rules (optim/rules.py) refuse the layouts nothing here assembles before
launch; the constructor refuses a parameter it cannot assemble again (never a silently wrong update)."""
from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megaframe.config.optim_rules import ADJUST_LR
from megaframe.optim.groups import Shape, full_shape
from megaframe.optim.pieces import Piece, PieceError, piece, tp_groups
from megaframe.optim.sharded import FlatPartition, ShardedMatrices
from megaframe.optim.table import group_optimizer


# The dtype Muon's exchanges carry pieces and assemble matrices in (optim/sharded.py): orthogonalise's
# first cast, so a piece cast before it travels is the bits the assembled matrix's cast would be, at half
# fp32's bytes; an fp32 parameter adds the bf16 result exactly as it added its fp32 copy.
EXCHANGE_DTYPE = torch.bfloat16


def orthogonalise(update: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz iteration in bf16 (an approximate U V^T of update = U S V^T),
    of a matrix (rows, cols) or of each matrix of a stack (E, rows, cols)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(-2) > update.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)  # spectral norm <= 1 (out of place: x may be the caller's bf16 buffer)
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


# The matrices stepped whole on this rank iterate in batches of one shape, at most this many elements
# each (1 MiB of bf16), as one (batch, rows, cols) stack: on the CPU a stack of small matrices iterates
# up to twice as fast as the same matrices one by one (fewer, larger GEMM calls; measured at hidden
# 128 and 256: the bench shapes), and each matrix's result is the one-by-one result to the bit (checked
# against torch.optim.Muon: tests/unit/optim/test_muon.py). A matrix of this size or more iterates
# alone, as it always did: a batch's memory stays bounded whatever the model.
NS_BATCH_ELEMENTS = 1 << 19


def same_shape_batches(items: Sequence, key: Callable, numel: Callable[..., int], budget: int) -> list[list]:
    """`items` in batches of equal key(item), each of at most `budget` elements (numel(item)) or of
    one item, in the order each batch's first item comes."""
    batches: list[list] = []
    filling: dict = {}  # key -> (the batch being filled, its elements)
    for item in items:
        k, n = key(item), numel(item)
        batch, total = filling.get(k, (None, 0))
        if batch is None or total + n > budget:
            batch, total = [], 0
            batches.append(batch)
        batch.append(item)
        filling[k] = (batch, total + n)
    return batches


def adjusted_lr(lr: float, adjust_lr: str, shape: Sequence[int]) -> float:
    """The matrix's learning rate: spectral sqrt(max(1, rows/cols)) (torch's "original"), or
    match_rms_adamw 0.2 sqrt(max(rows, cols)) (an update of AdamW's RMS). A stack's matrices are its
    last two dims."""
    rows, cols = shape[-2:]
    ratio = 0.2 * math.sqrt(max(rows, cols)) if adjust_lr == "match_rms_adamw" else math.sqrt(max(1, rows / cols))
    return lr * ratio


def whole(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a parameter (or its gradient or state): itself, or a DTensor's local
    tensor (the whole matrix on a mesh of one, its rows or whole experts of a stack where sharded)."""
    return t.to_local() if isinstance(t, DTensor) else t


def split_groups(params: Sequence[torch.nn.Parameter], pieces: Sequence[Piece], device: torch.device,
                 bucket_elements: int = 0) -> list[ShardedMatrices]:
    """One ShardedMatrices per group of ranks holding pieces, in the order the parameters first name
    each group (the same order on every rank: its collectives never cross). A group is known by its
    ranks, not by the object naming it (two meshes may each hold one of the same ranks)."""
    by_group: dict[tuple[int, ...], list[int]] = {}
    for i, part in enumerate(pieces):
        if part.group is not None:
            by_group.setdefault(tuple(dist.get_process_group_ranks(part.group)), []).append(i)
    return [ShardedMatrices([pieces[i] for i in members], device, params=[params[i] for i in members],
                            bucket_elements=bucket_elements, wire_dtype=EXCHANGE_DTYPE)
            for members in by_group.values()]


class Muon(torch.optim.Optimizer):
    """Muon on the param groups marked "optimizer": "muon", torch's AdamW on those marked "adamw"."""

    megaframe_name = "muon"  # optim/state.py: the name the checkpoint records

    def __init__(self, groups: list[dict], *, momentum: float, nesterov: bool, ns_coefficients: Sequence[float],
                 ns_steps: int, eps: float, adjust_lr: str, betas: tuple[float, float], adamw_eps: float,
                 fused: bool = True, ps=None, shape: Shape = full_shape, described: bool = False,
                 exchange_bucket_size: int = 0):
        """ps: the ParallelState, where tensor parallelism splits matrices (its groups assemble them).
        shape: a parameter's full shape, where the engine has already partitioned it away (ZeRO-3).
        described: the engine steps flat partitions in place of these parameters and describes where
        the matrices lie in them later (partition_flat, with around_tp's groups): no pieces now.
        exchange_bucket_size: the most elements of whole matrices one rank assembles per exchange
        (owners.bucket_owners; 0: one exchange per group of ranks), which bounds the step's transient
        memory."""
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr={adjust_lr!r}: one of {', '.join(ADJUST_LR)}")
        around_tp = tp_groups(ps)  # collective when made: every rank builds its optimizer at once
        self.around_tp = around_tp
        matrices, pieces = [], []
        for group in groups:
            for p in group["params"] if group_optimizer(group) == "muon" else ():
                if len(shape(p)) not in (2, 3):
                    raise ValueError(f"Muon steps matrices and stacks of them, not a tensor of shape {tuple(shape(p))}")
                if described:  # the engine's partition_flat says where its parts lie
                    matrices.append(p)
                    continue
                try:
                    pieces.append(piece(p, around_tp))
                except PieceError as e:
                    raise ValueError(f"Muon needs whole matrices; a {tuple(p.shape)} parameter is {e}") from None
                matrices.append(p)
        # the same group dicts: the schedule's lr reaches both; AdamW fills in its own defaults first
        self.adamw = torch.optim.AdamW([g for g in groups if group_optimizer(g) == "adamw"], lr=0.0, betas=betas,
                                       eps=adamw_eps, fused=fused)
        super().__init__(groups, dict(lr=0.0, weight_decay=0.0, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, eps=eps,
                                      adjust_lr=adjust_lr))
        self.adamw.state = self.state  # one state table: the checkpoint and the memory accounting read it
        # the learning rate adjusts by the whole matrix's shape, not by this rank's piece of it
        self.full_shapes = {id(p): part.full for p, part in zip(matrices, pieces)}
        device = whole(matrices[0]).device if matrices else torch.device("cpu")
        self.exchange_bucket_size = exchange_bucket_size  # the engine's described partitions use it too
        self.split = split_groups(matrices, pieces, device, exchange_bucket_size)
        # id(flat tensor) -> its matrices' parts, one FlatPartition per group of ranks assembling them
        self.flat_partitions: dict[int, list[FlatPartition]] = {}

    def partition_flat(self, flat: torch.Tensor, partitions: Sequence[FlatPartition]) -> None:
        """Step `flat` (a tensor an engine puts in a Muon group in place of its parameters: DeepSpeed
        ZeRO's fp32 partition) as the parts of whole matrices `partitions` describe (every rank the
        same groups of ranks in the same order: their exchanges never cross). The momentum is one
        buffer shaped like `flat`; Newton-Schulz runs on the matrices this rank owns."""
        self.flat_partitions[id(flat)] = list(partitions)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assembled = [[] for _ in self.split]  # per group of ranks: (group, param) of the matrices it assembles
        local = []  # (group, param) of the matrices whole on this rank: stepped in batches (_step_local)
        for group in self.param_groups:
            if group_optimizer(group) != "muon":
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                where = next((n for n, split in enumerate(self.split) if split.holds(p)), None)
                if where is None and id(p) not in self.flat_partitions:
                    local.append((group, p))
                    continue
                if id(p) in self.flat_partitions:
                    self._step_flat(group, p)
                else:
                    assembled[where].append((group, p))
        self._step_local(local)
        for split, items in zip(self.split, assembled):
            split.new_step()
            # every rank of the group the same matrices in the same order (they all have gradients), a
            # bucket at a time: its updates made, exchanged and applied before the next one's are made
            for bucket in split.in_buckets([split.index[id(p)] for _, p in items]):
                chosen = [items[k] for k in bucket]
                updates = [self._momentum(group, p) for group, p in chosen]
                results = split.orthogonalise([(p, u, _orthogonaliser(g)) for (g, p), u in zip(chosen, updates)])
                del updates
                for (group, p), update in zip(chosen, results):
                    self._apply(group, p, update)
        # only the AdamW groups the engine shows now: DeepSpeed's ZeRO-1/2 steps one group at a time
        # by narrowing param_groups (each other group's flat partition would be stepped again); and
        # this state table, which torch's load_state_dict (DeepSpeed's native resume) replaces
        every = self.adamw.param_groups
        self.adamw.param_groups = [g for g in self.param_groups if group_optimizer(g) == "adamw"]
        self.adamw.state = self.state
        try:
            self.adamw.step()
        finally:
            self.adamw.param_groups = every
        return loss

    def _step_local(self, items: list[tuple[dict, torch.nn.Parameter]]) -> None:
        """The matrices whole on this rank, in batches of one group and shape (same_shape_batches): each
        matrix's momentum moved and its update cast into its place in one bf16 stack (the cast
        orthogonalise makes first), the stack orthogonalised at once, each result applied. Memory
        beyond the parameters: one batch's stack and its iteration, one matrix's update at a time."""
        def rows_cols(item) -> tuple:
            return tuple(whole(item[1]).shape[-2:])

        for batch in same_shape_batches(items, key=lambda item: (id(item[0]), rows_cols(item), whole(item[1]).device),
                                        numel=lambda item: whole(item[1]).numel(), budget=NS_BATCH_ELEMENTS):
            group, first = batch[0]
            if len(batch) == 1:
                self._apply(group, first, _orthogonaliser(group)(self._momentum(group, first)))
                continue
            shapes = [whole(p).shape for _, p in batch]
            counts = [math.prod(shape[:-2]) for shape in shapes]  # a stack of experts takes that many places
            stack = torch.empty((sum(counts), *rows_cols(batch[0])), dtype=torch.bfloat16,
                                device=whole(first).device)
            places = [stack[at:at + n].view(shape) for at, n, shape in zip(itertools.accumulate(counts, initial=0),
                                                                             counts, shapes)]
            for (_, p), place in zip(batch, places):
                place.copy_(self._momentum(group, p))
            result = _orthogonaliser(group)(stack)
            for (_, p), at, n, shape in zip(batch, itertools.accumulate(counts, initial=0), counts, shapes):
                self._apply(group, p, result[at:at + n].view(shape))

    def _step_flat(self, group: dict, flat: torch.Tensor) -> None:
        """A flat partition's step: the momentum moved on the whole partition, then a bucket at a time
        (its matrices' updates made, exchanged, applied) each matrix's part of the update goes to the
        matrix's owner, comes back orthogonalised, and is applied to this rank's part at the rate its
        full shape adjusts (the partition's padding is never stepped)."""
        orthogonaliser = _orthogonaliser(group)
        grad, buf = self._moved(group, flat)
        for partition in self.flat_partitions[id(flat)]:
            matrices = partition.matrices
            matrices.new_step()
            grads, bufs, params = partition.parts(grad), partition.parts(buf), partition.parts(flat.data)
            for bucket in matrices.in_buckets(range(len(partition.offsets))):
                updates = [_update(group, grads[i], bufs[i]) for i in bucket]
                results = matrices.exchange([(i, update, orthogonaliser) for i, update in zip(bucket, updates)])
                del updates
                for i, result in zip(bucket, results):
                    _decay_and_step(group, params[i], result, matrices.shapes[i])

    def _momentum(self, group: dict, p: torch.nn.Parameter) -> torch.Tensor:
        """The momentum buffer moved towards the gradient, and the update (Nesterov's look-ahead or the
        buffer), on this rank's part of the parameter."""
        return _update(group, *self._moved(group, p))

    def _moved(self, group: dict, p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the gradient and of the momentum buffer, moved towards the gradient."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grad, buf = whole(p.grad), whole(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        return grad, buf

    def _apply(self, group: dict, p: torch.nn.Parameter, update: torch.Tensor) -> None:
        _decay_and_step(group, whole(p), update, self.full_shapes.get(id(p), p.shape))


def _update(group: dict, grad: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The update from the moved momentum buffer: Nesterov's look-ahead (a new tensor), or the buffer."""
    return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


def _decay_and_step(group: dict, param: torch.Tensor, update: torch.Tensor, shape: Sequence[int]) -> None:
    """Decoupled weight decay, then the orthogonalised update at the rate the matrix's full shape adjusts."""
    lr = group["lr"]
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr"], shape))


def _orthogonaliser(group: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda update: orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
