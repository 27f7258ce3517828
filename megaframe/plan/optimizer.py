"""The optimizer's terms in the plan, read from optim/table.py by the optimizer's name (never a branch
on it): the fp32 state tensors each parameter carries (Adam's two moments; Muon's one momentum
buffer for the hidden matrices, AdamW's two for the rest), and for an optimizer that orthogonalises
whole matrices (Muon) its Newton-Schulz FLOPs, the traffic of assembling the matrices an engine
splits (optim/pieces.py, sharded.py) and the transient memory of that step.

Where the work goes, as optim/pieces.py assembles: each matrix whole on one owner among the ranks
holding its parts. Where the engine partitions the optimizer's matrices (ZeRO >= 1 over dp x cp,
FSDP2 over dp x cp or HSDP's shard group: the shard group), a TP-split matrix is shared out over tp
x the shard group and one every TP rank holds whole (k and v where tp does not divide the kv heads)
over the shard group alone, so every TP rank runs it; expert stacks over their expert-data-parallel
shard group. Without partitions (ZeRO-0) only TP-split matrices are shared, over tp.

Newton-Schulz FLOPs, from optim/muon.py's orthogonalise: a matrix is iterated in its wide
orientation X (m x n, m <= n); each of ns_steps iterations computes gram = X Xᵀ (2·m·m·n), poly =
b·gram + c·gram·gram (2·m³) and X = a·X + poly·X (2·m·m·n): 2·(2·m²·n + m³) FLOPs (the scalings and
the norm are O(m·n), left out). A stack of E experts is E such matrices. tests/unit/plan checks it
against torch's FlopCounterMode over orthogonalise itself."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from megaframe.model.dims import GPTDims
from megaframe.optim.owners import bucket_owners
from megaframe.optim.table import ORTHOGONALISES, PARTS, state_tensors_per_param

FP32 = 4  # bytes: states, and Nesterov's updates
BF16 = 2  # bytes: what optim/sharded.py exchanges and assembles (optim/muon.py's EXCHANGE_DTYPE)


@dataclass(frozen=True)
class OptimizerTerms:
    """What the plan needs of optim.name: fp32 state tensors per parameter of the hidden matrices
    and of the rest, and Newton-Schulz iterations per step (0: none)."""

    matrix_states: int = 2
    other_states: int = 2
    ns_steps: int = 0
    nesterov: bool = False  # the update is a copy (Nesterov's look-ahead), not the momentum buffer itself
    bucket: int = 0  # the most elements of whole matrices one rank assembles per exchange (0: one exchange)

    @property
    def splits(self) -> bool:
        """Whether the hidden matrices carry other state than the rest (the plan then counts them apart)."""
        return self.matrix_states != self.other_states


ADAMW = OptimizerTerms()


def optimizer_terms(optim) -> OptimizerTerms:
    """The terms of optim (an OptimConfig; None: AdamW's)."""
    if optim is None:
        return ADAMW
    matrices, rest = PARTS[optim.name]
    orthogonalises = optim.name in ORTHOGONALISES
    return OptimizerTerms(state_tensors_per_param(matrices), state_tensors_per_param(rest),
                          optim.muon.ns_steps if orthogonalises else 0, orthogonalises and optim.muon.nesterov,
                          optim.muon.exchange_bucket_size if orthogonalises else 0)


def block_matrices(dims: GPTDims, moe_block: bool, tp: int = 1, ep: int = 1) -> list[tuple[int, int, int]]:
    """The hidden matrices of a block (optim/groups.py's is_hidden_matrix: attention and MLP
    projections, shared experts, each routed expert's projections; not the router) as (count, rows,
    cols) on one TP and ep rank: column-parallel ones split by rows, row-parallel ones by columns."""
    h, hs, per_width = dims.hidden_size, dims.head_dim, (2 if dims.activation == "swiglu" else 1)
    q = dims.num_heads * hs // tp
    kv = dims.num_kv_heads * hs // tp if dims.num_kv_heads % tp == 0 else dims.num_kv_heads * hs
    matrices = [(1, q, h), (2, kv, h), (1, h, q)]

    def mlp(width: int, split: int, count: int = 1) -> list[tuple[int, int, int]]:
        return [(count * per_width, width // split, h), (count, h, width // split)] if width else []
    if not moe_block:
        return matrices + mlp(dims.ffn_hidden_size, tp)
    moe = dims.moe
    return (matrices + mlp(moe.shared_experts * moe.ffn_hidden_size, tp)
            + mlp(moe.ffn_hidden_size, 1, moe.num_experts // ep))


def matrix_parameters(matrices: list[tuple[int, int, int]]) -> int:
    return sum(count * rows * cols for count, rows, cols in matrices)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of orthogonalising one rows x cols matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * 2.0 * (2 * m * m * n + m ** 3)


def stage_matrices(dims: GPTDims, dense_blocks: int, moe_blocks: int, tp: int = 1,
                   ep: int = 1) -> list[tuple[int, int, int]]:
    """The hidden matrices of a stage of dense_blocks + moe_blocks blocks, by kind (never per layer)."""
    held = [(count * dense_blocks, r, c) for count, r, c in block_matrices(dims, False, tp, ep)] if dense_blocks else []
    if moe_blocks:
        held += [(count * moe_blocks, r, c) for count, r, c in block_matrices(dims, True, tp, ep)]
    return held


@dataclass(frozen=True)
class Assembled:
    """`count` hidden matrices (or expert stacks of `stack` matrices each, iterated as one batch) of
    rows x cols as Newton-Schulz sees them (a TP-split matrix whole), assembled over the ranks of
    `axis` (owner_ranks): "tp" for TP-split ones (tp x the shard group), "whole" for those every
    TP rank holds whole (the shard group alone, so every TP rank runs them), "experts" for routed
    expert stacks (their expert-data-parallel shard group)."""

    count: int
    rows: int
    cols: int
    axis: str
    stack: int = 1
    blocks: int = 1  # the blocks `count` spans (count / blocks in each), all of one kind:
    kind: str = "dense"  # "dense" or "moe" blocks (exchange_order puts them in the model's order)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stack, self.rows, self.cols) if self.stack > 1 else (self.rows, self.cols)

    def flops(self, steps: int) -> float:
        """Newton-Schulz FLOPs of one of them (a whole stack)."""
        return shape_flops(self.shape, steps)

    @property
    def numel(self) -> int:
        return self.count * self.stack * self.rows * self.cols


def assembled_matrices(dims: GPTDims, dense_blocks: int, moe_blocks: int, tp: int = 1,
                       ep: int = 1) -> list[Assembled]:
    """The hidden matrices of a stage as optim/pieces.py assembles them: column- and row-parallel
    ones whole over tp x the shard group; k and v whole on every TP rank where tp does not divide
    the kv heads; routed expert stacks (never TP-split) of num_experts/ep experts each."""
    h, hs, per_width = dims.hidden_size, dims.head_dim, (2 if dims.activation == "swiglu" else 1)
    q, kv = dims.num_heads * hs, dims.num_kv_heads * hs
    kv_axis = "tp" if dims.num_kv_heads % tp == 0 else "whole"

    def block(ffn: int, n: int, kind: str) -> list[Assembled]:  # in a block's order: q, k, v, out, up, gate, down
        held = [Assembled(n, q, h, "tp", 1, n, kind), Assembled(2 * n, kv, h, kv_axis, 1, n, kind),
                Assembled(n, h, q, "tp", 1, n, kind)]
        return held + ([Assembled(per_width * n, ffn, h, "tp", 1, n, kind), Assembled(n, h, ffn, "tp", 1, n, kind)]
                       if ffn else [])
    held = block(dims.ffn_hidden_size, dense_blocks, "dense") if dense_blocks else []
    if moe_blocks:
        moe = dims.moe
        held += block(moe.shared_experts * moe.ffn_hidden_size, moe_blocks, "moe")
        stack = moe.num_experts // ep
        held += [Assembled(per_width * moe_blocks, moe.ffn_hidden_size, h, "experts", stack, moe_blocks, "moe"),
                 Assembled(moe_blocks, h, moe.ffn_hidden_size, "experts", stack, moe_blocks, "moe")]
    return held


def owner_ranks(tp: int, shard: int, expert_shard: int) -> dict[str, int]:
    """The ranks each axis's matrices are shared out over (Assembled): shard, the ranks the engine
    partitions the optimizer's matrices over (ZeRO >= 1's dp x cp, FSDP2's dp x cp or HSDP's
    dp_shard; 1 where it holds them whole), and expert_shard, those of the expert stacks."""
    return {"tp": tp * shard, "whole": shard, "experts": expert_shard}


def exchange_order(assembled: list[Assembled], axis: str, block_kinds: Sequence[str]) -> list[tuple[int, ...]]:
    """The shapes of an axis's matrices in the order the optimizer exchanges them: the model's
    parameter order, block by block in the stage's order of dense and MoE blocks (block_kinds:
    plan/memory.py stage_block_kinds), so that they fall into the optimizer's buckets as they do."""
    per_block = {kind: [a for a in assembled if a.kind == kind and a.axis == axis and a.count] for kind in ("dense", "moe")}
    return [a.shape for kind in block_kinds for a in per_block[kind] for _ in range(a.count // a.blocks)]


def shape_flops(shape: tuple[int, ...], steps: int) -> float:
    """Newton-Schulz FLOPs of one matrix, or of a stack of them (experts x rows x cols)."""
    *stack, rows, cols = shape
    return math.prod(stack) * newton_schulz_flops(rows, cols, steps)


def busiest_rank_flops(shapes: Sequence[tuple[int, ...]], ranks: int, steps: int, bucket: int) -> float:
    """Newton-Schulz FLOPs of a step on the busiest rank: per bucket (optim/owners.py) the most any owner
    runs, summed over the buckets (each exchange waits for its slowest owner)."""
    return sum(busiest for _, busiest, _ in bucket_loads(tuple(shapes), ranks, steps, bucket))


@functools.lru_cache(maxsize=256)  # the search plans many layouts whose stages hold the same matrices
def bucket_loads(shapes: tuple[tuple[int, ...], ...], ranks: int, steps: int,
                 bucket: int) -> tuple[tuple[int, float, int], ...]:
    """Per bucket of optim/owners.py's (in exchange order): its elements of whole matrices, the most
    Newton-Schulz FLOPs any of its owners runs, and the most elements any of them assembles."""
    runs, owners = bucket_owners(shapes, ranks, bucket)
    loads = []
    for members in runs:
        flops: dict[int, float] = {}  # only the owners of this bucket (not every rank of thousands)
        held: dict[int, int] = {}
        for i in members:
            flops[owners[i]] = flops.get(owners[i], 0.0) + shape_flops(shapes[i], steps)
            held[owners[i]] = held.get(owners[i], 0) + math.prod(shapes[i])
        loads.append((sum(math.prod(shapes[i]) for i in members), max(flops.values()), max(held.values())))
    return tuple(loads)


def stage_newton_schulz_flops(assembled: list[Assembled], terms: OptimizerTerms, owners: dict[str, int],
                              block_kinds: Sequence[str]) -> float:
    """Newton-Schulz FLOPs the busiest rank runs per step: each axis's matrices (of the stage's blocks,
    block_kinds in order) shared out over its owner ranks as optim/owners.py shares them, bucket by
    bucket (terms.bucket). About total / ranks, at least the largest matrix, where each bucket holds
    several matrices per rank; up to the costliest matrix of each bucket, summed, where owners hold one
    each (every exchange waits for its busiest owner)."""
    if not terms.ns_steps:
        return 0.0
    return sum(busiest_rank_flops(shapes, ranks, terms.ns_steps, terms.bucket)
               for axis, ranks in owners.items() if (shapes := exchange_order(assembled, axis, block_kinds)))


def assembly_bytes(elements: int, owners: int) -> float:
    """Bytes one rank sends per step assembling `elements` (of whole matrices) split over `owners`
    ranks on their owners: its part of each matrix to the matrix's owner, and the owner's result
    parts back, in bf16 (optim/sharded.py's two all_to_all_single); its parts of the matrices it owns
    stay local: 2 x 2 bytes x elements/owners x (owners-1)/owners."""
    if owners <= 1 or not elements:
        return 0.0
    return 2 * BF16 * elements / owners * (owners - 1) / owners


def stage_assembly_bytes(assembled: list[Assembled], owners: dict[str, int]) -> float:
    """assembly_bytes of every axis's matrices over their owner ranks."""
    return sum(assembly_bytes(sum(a.numel for a in assembled if a.axis == axis), ranks)
               for axis, ranks in owners.items())


def step_working_bytes(assembled: list[Assembled], owners: dict[str, int], terms: OptimizerTerms,
                       block_kinds: Sequence[str]) -> float:
    """Transient bytes of the optimizer step of an orthogonalising optimizer, when activations are
    gone: the largest exchange, then the Newton-Schulz working set of the largest matrix.

    optim/muon.py steps the groups of ranks one after another and each group a bucket at a time
    (optim/owners.py's buckets, over each axis's matrices in exchange order: terms.bucket bounds what
    one owner assembles in a bucket), freeing each bucket's buffers before the next. During a bucket's
    exchange a rank holds its share of the bucket's matrices (numel / ranks: the pieces it sends, in
    bf16, and with Nesterov their fp32 updates, a copy; else the momentum buffer itself) and the
    pieces of the matrices it owns there (in bf16: the received buffer, into which their results are
    cut back in place), and then the pieces that come back (its share again, the send buffer freed
    by then). So: the largest over the axes split over more than one rank and their buckets of
    (2 + 4 with Nesterov) x numel / ranks + 2 x the most any owner assembles there. Then the
    Newton-Schulz working set of the largest matrix as assembled (a TP-split one whole) or of an
    expert stack (iterated as one batch), added as if it came at the exchange's peak (an upper bound:
    it comes between the two all_to_all, the send buffer freed): the matrix in bf16 (assembled so,
    or orthogonalise's cast of an update whole on this rank, which with Nesterov is also an fp32
    copy), the iterate, the next one and the m x m Gram matrix and polynomial, in bf16. Not modelled:
    uneven pieces (a rank's share is taken as numel / ranks), and the exchange of a group of one rank
    (DeepSpeed's expert groups at ep = dp: its pieces copied to bf16, an axis of one rank here)."""
    share = BF16 + terms.nesterov * FP32  # bytes per element of this rank's share of a bucket
    exchange = max((share * numel / ranks + BF16 * held
                    for axis, ranks in owners.items() if ranks > 1
                    for numel, _, held in bucket_loads(tuple(exchange_order(assembled, axis, block_kinds)), ranks,
                                                       terms.ns_steps, terms.bucket)), default=0.0)

    def iteration(a: Assembled) -> float:
        m = min(a.rows, a.cols)
        update = terms.nesterov * FP32 if owners[a.axis] <= 1 else 0  # not exchanged: its fp32 update, cast
        return a.stack * ((update + BF16) * a.rows * a.cols + BF16 * (2 * a.rows * a.cols + 2 * m * m))
    return exchange + max((iteration(a) for a in assembled if a.count), default=0.0)
