"""The optimizer's terms in the plan, read from optim/table.py by the optimizer's name (never a branch
on it): the fp32 state tensors each parameter carries (Adam's two moments; Muon's one momentum
buffer for the hidden matrices, AdamW's two for the rest), and for an optimizer that orthogonalises
whole matrices (Muon) its Newton-Schulz FLOPs, the traffic of assembling the matrices an engine
splits by rows (optim/sharded.py) and the transient memory of that step.

Newton-Schulz FLOPs, from optim/muon.py's orthogonalise: a matrix is iterated in its wide
orientation X (m x n, m <= n); each of ns_steps iterations computes gram = X Xᵀ (2·m·m·n), poly =
b·gram + c·gram·gram (2·m³) and X = a·X + poly·X (2·m·m·n): 2·(2·m²·n + m³) FLOPs (the scalings and
the norm are O(m·n), left out). A stack of E experts is E such matrices. tests/unit/plan checks it
against torch's FlopCounterMode over orthogonalise itself."""
from __future__ import annotations

from dataclasses import dataclass

from megaframe.model.dims import GPTDims
from megaframe.optim.table import ORTHOGONALISES, PARTS, state_tensors_per_param

FP32 = 4  # bytes: states, and the rows optim/sharded.py exchanges (.float())


@dataclass(frozen=True)
class OptimizerTerms:
    """What the plan needs of optim.name: fp32 state tensors per parameter of the hidden matrices
    and of the rest, and Newton-Schulz iterations per step (0: none)."""

    matrix_states: int = 2
    other_states: int = 2
    ns_steps: int = 0
    nesterov: bool = False  # the update is a copy (Nesterov's look-ahead), not the momentum buffer itself

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
                          optim.muon.ns_steps if orthogonalises else 0, orthogonalises and optim.muon.nesterov)


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


def expert_matrix_parameters(dims: GPTDims, ep: int = 1) -> int:
    """The routed experts' part of an MoE block's hidden matrices (3D stacks: never split by rows)."""
    moe = dims.moe
    per_width = 2 if dims.activation == "swiglu" else 1
    return (moe.num_experts // ep) * (per_width + 1) * moe.ffn_hidden_size * dims.hidden_size


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


def stage_newton_schulz_flops(matrices: list[tuple[int, int, int]], terms: OptimizerTerms, owners: int) -> float:
    """Newton-Schulz FLOPs one rank runs per step: its stage's matrices shared out over the `owners`
    ranks that split them (optim/sharded.py balances whole matrices by this cost), 1 where each rank
    holds its matrices whole."""
    if not terms.ns_steps:
        return 0.0
    return sum(count * newton_schulz_flops(r, c, terms.ns_steps) for count, r, c in matrices) / owners


def assembly_bytes(row_split: int, owners: int) -> float:
    """Bytes one rank sends per step assembling the row-split matrices (row_split parameters, the 2D
    ones; a stack splits by whole experts) on their owners: its rows of each matrix to the matrix's
    owner, and the owner's result rows back, in fp32 (optim/sharded.py's two all_to_all_single);
    its rows of the matrices it owns stay local: 2 x 4 bytes x row_split/owners x (owners-1)/owners."""
    if owners <= 1 or not row_split:
        return 0.0
    return 2 * FP32 * row_split / owners * (owners - 1) / owners


def step_working_bytes(dims: GPTDims, row_split: int, owners: int, terms: OptimizerTerms, tp: int = 1,
                       ep: int = 1) -> float:
    """Transient bytes of the optimizer step of an orthogonalising optimizer, when activations are
    gone. With matrices split over `owners`, optim/sharded.py holds at once, in fp32, about
    row_split/owners elements in each of two exchange buffers (the pieces it sends and those it
    receives; then the received buffer, into which the owned matrices' results are cut back in place,
    and the pieces that come back), plus with Nesterov the updates of every split matrix (a copy;
    else the momentum buffers themselves): 2 (3 with Nesterov) x 4 bytes x row_split/owners. Then the Newton-Schulz working set of the
    largest matrix, or of an expert stack (iterated as one batch): its fp32 update, and in bf16 the
    iterate, the next one and the m x m Gram matrix and polynomial."""
    exchange = (2 + terms.nesterov) * FP32 * row_split / owners if owners > 1 else 0.0

    def iteration(rows: int, cols: int) -> float:
        m = min(rows, cols)
        return FP32 * rows * cols + 2 * (2 * rows * cols + 2 * m * m)
    # the matrices iterated one at a time: a dense block's, and an MoE block's but its last two
    # entries (the expert stacks, block_matrices)
    blocks = [block_matrices(dims, False, tp, ep)] + ([block_matrices(dims, True, tp, ep)[:-2]] if dims.moe else [])
    plain = max(iteration(r, c) for matrices in blocks for _, r, c in matrices)
    stack = (dims.moe.num_experts // ep) * iteration(dims.moe.ffn_hidden_size, dims.hidden_size) if dims.moe else 0.0
    return exchange + max(plain, stack)
