"""Activation memory: bytes saved for backward, per micro-batch, and the 1F1B in-flight count.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models") count,
per layer and 16-bit activations, s·b·h·(34 + 5·a·s/h) bytes: 2 bytes per element of the two norm
inputs, the QKV input, Q, K, V, the out-projection input, the MLP input, its 4h-wide GeLU input
and output (16 elements of s·b·h), 1-byte masks of two dropouts (2 s·b·h bytes) and the
a·s² attention scores, softmax and dropout mask (5·a·s²·b bytes).

This code base's block differs, and the formula below follows it tensor by tensor:
- no dropout masks when model.dropout=0 (the recipes' pre-training setting); otherwise a mask per
  element, one byte on CUDA and the activation dtype on CPU, and on CPU attention dropout runs
  SDPA's math path, which keeps three heads·s² tensors (probabilities, mask, dropped probabilities);
- attention is torch SDPA (flash/memory-efficient): no s² scores, but it keeps its output (which
  the out-projection also keeps: same storage) and a fp32 logsumexp of a·s·b;
- element size is the activation dtype (4 for fp32, 2 for bf16/fp16); norms keep fp32 statistics;
- Llama flavour: RMSNorm computes in fp32 (keeps its fp32 input and normalised value); RoPE's
  multiplies by the constant cos/sin tables keep only the (shared, cached) tables, so q and k are
  kept once, rotated, by SDPA; SwiGLU keeps gate, silu(gate), up and their product;
- grouped-query attention: K and V are kv_heads wide (SDPA repeats them without copies), as wide as
  the query heads in a block whose mask restricts more than causal (they are repeated for SDPA);
- tensor parallelism t divides everything inside the TP regions; the norm inputs/outputs are
  replicated (Korthikanti's 10 + 24/t), and with sequence parallelism split along the sequence.
  Unlike Megatron, our SP saves the all-gathered norm output for the QKV/MLP linears (not the
  shard), so only the norm's own tensors shrink by t;
- full recomputation keeps each block's input (Korthikanti's 2·s·b·h), plus one block's
  activations alive while its backward recomputes it;
- context parallelism cp: every count above is over the rank's s/cp tokens. Ring attention keeps
  what SDPA keeps plus its fp32 output (the same storage as the out-projection input in fp32, a
  second copy otherwise); Ulysses keeps SDPA's tensors on the all-to-all'd copies plus the
  out-projection input, which is no longer SDPA's output. With dropout, ring attention keeps no
  masks (it redraws them in the backward), and Ulysses' SDPA takes the math path on CPU over the
  whole sequence on heads/cp heads (the same bytes as heads over s/cp);
- masked attention (model/attention.py's SDPACore): a block whose mask restricts more than causal
  (a sliding window W < s, or data.document_mask) hands SDPA a boolean mask, which SDPA turns into an
  additive one in the activation dtype and keeps for backward: s² elements per block for a window
  (one mask for the micro-batch), b·s² with documents (one per sample). The planner cannot know the
  documents' lengths and needs none: the mask is s² whatever they are. With documents, positions are
  per token: learned ones keep the (b, s) int64 position ids, RoPE the (b, 1, s, head_dim) fp32
  cos and sin rows of every token instead of the cached tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaframe.model.dims import GPTDims, capacity_slots
from megaframe.plan.memory import ACTIVATION_BYTES


@dataclass(frozen=True)
class ActivationShape:
    """What the activation formulas need beyond the model shape."""

    micro_batch_size: int
    tp: int = 1
    sequence_parallel: bool = False
    dtype: str = "bf16"
    device: str = "cuda"  # cuda | cpu: where dropout's kernels differ (see block_activation_bytes)
    cp: int = 1
    cp_impl: str = "ring"


def tokens(dims: GPTDims, shape: ActivationShape) -> int:
    """s·b: the tokens of one micro-batch this rank holds (its s/cp share of each sequence)."""
    return dims.seq_length // shape.cp * shape.micro_batch_size


def _norm_bytes(dims: GPTDims, n_tokens: float, e: int) -> float:
    """Bytes a norm keeps for backward on `n_tokens` tokens (its output is counted by its consumer)."""
    h = dims.hidden_size
    if dims.norm == "rmsnorm":
        # x.float() (fp32 input copy; the input itself in fp32), rsqrt statistics, normalised value in the activation dtype
        return n_tokens * (4 * h + 4 + e * h)
    return n_tokens * (e * h + 2 * e)  # input + mean and rstd (in the activation dtype on CPU)


def attention_mask_bytes(dims: GPTDims, shape: ActivationShape, windowed: bool = True) -> float:
    """What SDPA keeps of a block's restricting mask (module docstring), windowed: whether the block
    attends through model.sliding_window (the pattern's local layers). Plain causal attention keeps
    none (SDPA's is_causal), nor does FlexAttention (model.attention_core=flex), whose BlockMask
    lists tiles: (s/128)² int32 a sample, built once a forward for every block. Under context
    parallelism none either: validation refuses Ulysses with a restricting mask (it would build the
    mask dense over the whole sequence: config/attention_rules.py), and the ring keeps no mask for
    backward; it masks each score tile in the forward and again in the backward, a transient of at
    most ring.py's _SCORE_ELEMENTS (2**26) scores, batch and heads included."""
    if shape.cp > 1 or dims.attention_core == "flex":  # flex: a BlockMask of tile lists, KiBs, one a forward
        return 0.0
    s, e = dims.seq_length, ACTIVATION_BYTES[shape.dtype]
    if dims.document_mask:
        return shape.micro_batch_size * s * s * e
    return s * s * e if windowed and dims.sliding_window is not None and dims.sliding_window < s else 0.0


def block_activation_bytes(dims: GPTDims, shape: ActivationShape, windowed: bool = True) -> float:
    """Bytes one transformer block saves for backward on one TP rank for one micro-batch (windowed:
    a block of the window pattern's local layers, whose mask SDPA keeps)."""
    e = ACTIVATION_BYTES[shape.dtype]
    t = shape.tp
    sb = tokens(dims, shape)
    sb_norm = sb / t if shape.sequence_parallel and t > 1 else sb  # norms run on sequence shards under SP
    h, hs, f = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    q = dims.num_heads * hs // t
    kv = dims.num_kv_heads * hs // t if dims.num_kv_heads % t == 0 else dims.num_kv_heads * hs
    heads = dims.num_heads // t
    dropout = dims.dropout > 0
    mask = dropout_mask_bytes(dims, shape)

    attention = sb * e * h  # QKV input (the norm output; shared by the three projections)
    math_path = dropout and shape.device == "cpu" and not (shape.cp > 1 and shape.cp_impl == "ring")
    if math_path:
        # SDPA's math path (the CPU's fused kernels take no dropout), in fp32 whatever the dtype: q,
        # k transposed and v, expanded to every query head, then the softmax output, its dropout
        # mask and the dropped probabilities; under Ulysses over the whole sequence on heads/cp
        # heads, the same bytes. (Ring attention redraws its masks in the backward: nothing more.)
        attention += 3 * sb * 4 * q + 3 * heads * dims.seq_length * sb * 4
    else:
        # flash / memory-efficient SDPA (dropout inside the kernel, regenerated from its RNG state):
        # Q, K (rotated under RoPE), V and an fp32 logsumexp. With a restricting mask SDPA gets K
        # and V repeated to every query head (no fused CUDA kernel takes a mask with GQA:
        # parallel/context.py's kv_heads_for_mask), and keeps them so
        masked = dims.attention_core == "sdpa" and attention_mask_bytes(dims, shape, windowed) > 0
        attention += sb * e * (q + 2 * (q if masked else kv)) + sb * heads * 4
    attention += sb * e * q  # SDPA output (= out-projection input)
    if shape.cp > 1 and ((shape.cp_impl == "ulysses" and not math_path) or (shape.cp_impl == "ring" and e != 4)):
        # ring: its fp32 output besides the out-projection's input; Ulysses: the out-projection's
        # input, all-to-all'd back from SDPA's output (which the math path does not keep)
        attention += sb * (4 if shape.cp_impl == "ring" else e) * q
    if shape.cp > 1 and shape.cp_impl == "ulysses":
        attention += 2 * 8 * dims.seq_length  # the int64 zig-zag permutations its reorderings keep
    attention += sb_norm * mask * h  # residual dropout mask

    mlp = sb * e * h  # MLP input (the norm output, shared by up/gate)
    mlp += sb * e * (f // t) * (4 if dims.activation == "swiglu" else 2)
    mlp += sb_norm * mask * h
    attention += attention_mask_bytes(dims, shape, windowed)
    return 2 * _norm_bytes(dims, sb_norm, e) + attention + mlp


def block_input_bytes(dims: GPTDims, shape: ActivationShape) -> float:
    """What full recomputation keeps per block: its input (a sequence shard under SP)."""
    sb = tokens(dims, shape)
    split = shape.tp if shape.sequence_parallel and shape.tp > 1 else 1
    return sb / split * dims.hidden_size * ACTIVATION_BYTES[shape.dtype]


def dropout_mask_bytes(dims: GPTDims, shape: ActivationShape) -> int:
    """Bytes per element of a dropout mask: none at dropout 0, a byte on CUDA (its fused kernel),
    the activation dtype on CPU (the scaled noise)."""
    if dims.dropout == 0:
        return 0
    return 1 if shape.device == "cuda" else ACTIVATION_BYTES[shape.dtype]


def embedding_activation_bytes(dims: GPTDims, shape: ActivationShape) -> float:
    """First stage: token ids kept by the lookup (int64), their out-of-shard mask, and the embedding
    dropout's mask (a sequence shard under SP)."""
    sb = tokens(dims, shape)
    sb_shard = sb / shape.tp if shape.sequence_parallel and shape.tp > 1 else sb
    # data.document_mask: learned positions restart per document, looked up from (b, s) int64 ids
    positions = sb * 8 if dims.document_mask and dims.position_embedding == "learned" else 0
    return sb * (8 + 1) + positions + sb_shard * dims.hidden_size * dropout_mask_bytes(dims, shape)


def head_activation_bytes(dims: GPTDims, shape: ActivationShape) -> float:
    """Last stage: final norm and the loss's fp32 softmax-sized tensor (Korthikanti's 4·s·b·v).

    One rank: F.cross_entropy keeps log_softmax over the real vocabulary; TP: our vocab-parallel
    loss keeps exp() of this rank's padded-vocabulary shard."""
    e = ACTIVATION_BYTES[shape.dtype]
    sb = tokens(dims, shape)
    sb_norm = sb / shape.tp if shape.sequence_parallel and shape.tp > 1 else sb
    vocab = dims.vocab_size if shape.tp == 1 else dims.padded_vocab_size // shape.tp
    head_input = sb * e * dims.hidden_size  # the final norm's output, gathered under SP
    return _norm_bytes(dims, sb_norm, e) + head_input + sb * 4 * vocab + sb * 8  # + int64 targets


def logits_working_bytes(dims: GPTDims, shape: ActivationShape) -> float:
    """Transient on the last stage, not kept for backward: the logits and their fp32 copy."""
    e = ACTIVATION_BYTES[shape.dtype]
    sb = tokens(dims, shape)
    vocab = dims.padded_vocab_size // shape.tp
    return sb * vocab * (e + 4)


def moe_mlp_extra_bytes(dims: GPTDims, shape: ActivationShape) -> float:
    """What an MoE block saves for backward beyond a dense block's (tests/unit/plan: the tensors
    autograd saves, counted; tests/dist/test_planner_peak.py: the peak of a run): the dense MLP's term is replaced by the router's fp32 logits and scores, the k
    copies of each token sent to experts, the experts' gate/up outputs and their product (width
    f of one expert, k copies), the k expert outputs and their weights, plus the shared experts' MLP.
    Each TP rank routes 1/tp of the tokens."""
    e, moe = ACTIVATION_BYTES[shape.dtype], dims.moe
    t = shape.tp
    sb = tokens(dims, shape)
    h, f = dims.hidden_size, moe.ffn_hidden_size
    per_width = 4 if dims.activation == "swiglu" else 2
    # both blocks keep the MLP input (the norm output); the dense one then its MLP's internals
    dense_internals = sb * e * (dims.ffn_hidden_size // t) * per_width
    routed = sb / t
    # fp32 logits and scores; below fp32, the router keeps its fp32 copy of the input, and the
    # input itself is then kept only by the shared experts (the dense block counts it)
    router = routed * moe.num_experts * 4 * 2
    if e != 4:
        router += routed * h * 4 - (0 if moe.shared_experts else sb * e * h)
    assignments = routed * moe.top_k
    # the rows the experts compute: one per assignment dropless; under a capacity factor, fixed
    # buffers of num_experts x capacity rows (a factor of 2 doubles them), which the assignments are
    # copied into
    rows = assignments if moe.capacity_factor is None else \
        moe.num_experts * capacity_slots(int(routed), moe.top_k, moe.num_experts, moe.capacity_factor)
    # per assignment: sent rows, expert outputs, weights and three int64 indices (the choices, the rows
    # to send, the way back); per row computed: the experts' internals (and a capacity's buffer)
    experts = assignments * (2 * h * e + 4 + 3 * 8) + rows * f * e * per_width
    if moe.capacity_factor is not None:
        experts += rows * h * e
    shared = sb * e * (moe.shared_experts * f // t) * per_width
    return router + experts + shared - dense_internals


def stage_activation_bytes(dims: GPTDims, shape: ActivationShape, blocks: int, first: bool, last: bool,
                           recompute: bool, moe_blocks: int = 0, windowed_blocks: Optional[int] = None) -> float:
    """Bytes one micro-batch leaves saved on a stage of `blocks` blocks, `moe_blocks` of them
    Mixture-of-Experts, `windowed_blocks` of them attending through the sliding window (None: as
    many as among the model's first `blocks`) (without the recompute working set)."""
    per_block = block_input_bytes(dims, shape) if recompute else block_activation_bytes(dims, shape, windowed=False)
    total = blocks * per_block
    if not recompute:
        windowed = dims.windowed_blocks_in(0, blocks) if windowed_blocks is None else windowed_blocks
        # their mask, and K and V repeated to every query head for the masked call
        total += windowed * (block_activation_bytes(dims, shape, True) - block_activation_bytes(dims, shape, False))
    if moe_blocks and not recompute:
        total += moe_blocks * moe_mlp_extra_bytes(dims, shape)
    if blocks and dims.position_embedding == "rope" and not recompute:
        # RoPE's fp32 cos/sin: cached, one copy per process (recomputation saves only block inputs);
        # under cp also the rows of this rank's positions, cached too; with documents, each token's
        # own rows (b, 1, s, head_dim) in place of the tables (measured: the tables are not saved then)
        rows = tokens(dims, shape) if dims.document_mask else dims.seq_length
        total += 2 * dims.head_dim * 4 * (rows + (dims.seq_length // shape.cp if shape.cp > 1 else 0))
    if first:
        total += embedding_activation_bytes(dims, shape)
    if last:
        total += head_activation_bytes(dims, shape)
    return total


def fp8_cast_bytes(dims: GPTDims, shape: ActivationShape, fp8) -> float:
    """Transient on a stage with fp8 linears (precision.fp8), not kept for backward: torchao casts
    each fp8 linear's operands per matmul (parallel/fp8/: activations are saved in bf16, no fp8
    weight copy persists), so one linear's copies live at a time, the most in its backward: the
    weight's, the output gradient's and the input's, a byte per element (M tokens, K in, N out:
    K·N + M·K + M·N), with MXFP8's one-byte scale per 32 elements; tensorwise and rowwise scales
    are a few fp32 numbers per tensor or row, left out. Of the largest fp8 linear on this TP rank:
    the LM head with fp8.head, else the widest block projection."""
    if not fp8.enabled:
        return 0.0
    t, h = shape.tp, dims.hidden_size
    f = max(dims.ffn_hidden_size, dims.moe.shared_experts * dims.moe.ffn_hidden_size if dims.moe else 0)
    q = dims.num_heads * dims.head_dim
    linears = [(h, q // t), (q // t, h), (h, f // t), (f // t, h)]  # (in, out) on this TP rank
    if fp8.head:
        linears.append((h, dims.padded_vocab_size // t))
    m = tokens(dims, shape)
    copies = max(k * n + m * (k + n) for k, n in linears)
    return copies * (1 + 1 / 32 if fp8.recipe == "mxfp8" else 1)
