"""Memory formulas of the planner: parameters per pipeline stage and TP rank, ZeRO model states,
activations saved for backward, and the 1F1B peak.

Parameter counts follow the modules in megaframe/model exactly (the meta-device dry run in
dryrun.py checks that), pipeline stages are cut with the same DeepSpeed partitioning as
PipelineModule. Model states are the ZeRO paper's accounting; activations are Korthikanti et al.
(2022) re-derived for this code base's block (see block_activation_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


from megaframe.backends.facts import SHARDED_FP32, ZERO_PAPER
from megaframe.backends.registry import DEFAULT
from megaframe.config.validate import ConfigError
from megaframe.model.dims import GPTDims
from megaframe.model.spec import ModelSpec
from megaframe.parallel.dims import OnGrid, ParallelDims
from megaframe.parallel.pipeline_schedules import partition_balanced

GIB = 2**30
# Bytes per element of the weights, gradients and optimizer states of each precision. Mixed
# precision (bf16/fp16) is the ZeRO paper's K=12: fp32 master weights, Adam m and v.
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class PlanLayout(OnGrid):
    """One candidate layout: the rank grid (its degrees are ParallelDims', HSDP's dp_replicate
    included), batch shape and the memory-saving switches."""

    grid: ParallelDims
    micro_batch_size: int
    global_batch_size: int
    zero_stage: int = 0
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"
    recompute: bool = False
    sequence_parallel: bool = False
    partition: str = "uniform"  # uniform | parameters (PipelineModule's partition method)
    cp_impl: str = "ring"  # ring | ulysses, when grid.cp > 1
    engine: str = DEFAULT  # backend.name: who holds the model states, and how (its facts' memory terms)
    pipeline_schedule: str = "1f1b"  # parallel.pipeline_schedule (fsdp2's schedules; DeepSpeed runs 1f1b)
    virtual_stages: int = 1  # parallel.virtual_stages: stages per pipeline rank

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank per optimizer step (the 1F1B schedule's m)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def describe(self) -> str:
        off = self.offload_optimizer if self.offload_param == "none" else f"{self.offload_optimizer}+param:{self.offload_param}"
        cp = f" cp_impl={self.cp_impl}" if self.cp > 1 else ""  # as the start-up line says it
        engine = f" backend={self.engine}" if self.engine != DEFAULT else ""
        if self.pp > 1 and self.pipeline_schedule != "1f1b":
            v = f" x{self.virtual_stages}" if self.pipeline_schedule in ("interleaved_1f1b", "zero_bubble") else ""
            engine += f" schedule={self.pipeline_schedule}{v}"
        return (f"{self.grid.describe()}{cp} zero={self.zero_stage} offload={off} "
                f"recompute={'full' if self.recompute else 'none'} sp={str(self.sequence_parallel).lower()}{engine}")


# ---- parameters ------------------------------------------------------------------------------

def _norm_parameters(dims: GPTDims) -> int:
    return dims.hidden_size * (2 if dims.norm == "layernorm" and dims.bias else 1)


def _mlp_parameters(dims: GPTDims, f: int, tp: int) -> int:
    """A dense MLP of width f, column/row-parallel over tp (model/gpt.py: MLP)."""
    h, bias = dims.hidden_size, 1 if dims.bias else 0
    mlp_in = (2 if dims.activation == "swiglu" else 1) * (h * f // tp + bias * f // tp)
    return mlp_in + f // tp * h + bias * h


def expert_parameters(dims: GPTDims) -> int:
    """One routed expert (model/moe.py: Experts): gate (SwiGLU), up and down, no biases."""
    return (3 if dims.activation == "swiglu" else 2) * dims.hidden_size * dims.moe.ffn_hidden_size


def block_expert_parameters(dims: GPTDims, index: int, ep: int = 1) -> int:
    """The routed experts one rank holds of block `index` (experts are split over ep, not TP)."""
    return _moe_block_expert_parameters(dims, ep) if dims.is_moe_block(index) else 0


def _moe_block_expert_parameters(dims: GPTDims, ep: int) -> int:
    return dims.moe.num_experts // ep * expert_parameters(dims)


def block_parameters(dims: GPTDims, tp: int, index: int = 0, ep: int = 1) -> int:
    """Block `index`'s parameters on one TP rank (model/gpt.py: Block), its routed experts included
    (this ep rank's share): an MoE block has a router (replicated) and shared experts (an MLP)."""
    return block_kind_parameters(dims, tp, dims.is_moe_block(index), ep)


def block_kind_parameters(dims: GPTDims, tp: int, moe_block: bool, ep: int = 1) -> int:
    """The parameters of a dense block, or of an MoE block (moe_block), on one TP and ep rank: every
    block of a kind has the same, so the planner counts kinds, never layers (10**8 layers plan in
    microseconds)."""
    h, hs, f = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    q, kv = dims.num_heads * hs, dims.num_kv_heads * hs
    bias = 1 if dims.bias else 0
    kv_local = kv // tp if dims.num_kv_heads % tp == 0 else kv  # fewer kv heads than TP ranks: replicated
    attention = h * q // tp + bias * q // tp + 2 * (h * kv_local + bias * kv_local) + q // tp * h + bias * h
    attention += 2 * hs if dims.qk_norm else 0
    if not moe_block:
        return 2 * _norm_parameters(dims) + attention + _mlp_parameters(dims, f, tp)
    moe = dims.moe
    shared = _mlp_parameters(dims, moe.shared_experts * moe.ffn_hidden_size, tp) if moe.shared_experts else 0
    return (2 * _norm_parameters(dims) + attention + moe.num_experts * h + shared
            + _moe_block_expert_parameters(dims, ep))


def block_kind_replicated_parameters(dims: GPTDims, tp: int, moe_block: bool, sequence_parallel: bool,
                                     ep: int = 1) -> int:
    """Of block_kind_parameters, those every TP rank holds whole and applies to its own share of the
    data, whose gradients are summed over TP (tp.sync_grad in model/gpt.py, model/moe.py and
    parallel/layers.py): kv projections replicated when TP exceeds the kv heads, per-head q/k norms,
    an MoE block's router and this rank's experts (each TP rank routes its own tokens), and under
    sequence parallelism the norms and the row-parallel biases. None at tp=1."""
    if tp == 1:
        return 0
    h, kv, bias = dims.hidden_size, dims.num_kv_heads * dims.head_dim, 1 if dims.bias else 0
    replicated = 2 * (h * kv + bias * kv) if dims.num_kv_heads % tp else 0
    replicated += 2 * dims.head_dim if dims.qk_norm else 0
    # the MLP's row-parallel bias: a dense block's, an MoE block's shared experts' (routed experts have none)
    mlp_bias = bias * h if not moe_block or dims.moe.shared_experts else 0
    if sequence_parallel:
        replicated += 2 * _norm_parameters(dims) + bias * h + mlp_bias
    if moe_block:
        replicated += dims.moe.num_experts * h + _moe_block_expert_parameters(dims, ep)
    return replicated


def stage_replicated_parameters(dims: GPTDims, tp: int, sequence_parallel: bool, dense_blocks: int,
                                moe_blocks: int, last: bool, ep: int = 1) -> int:
    """block_kind_replicated_parameters over a stage's blocks, and the final norm on the last stage
    under sequence parallelism."""
    final_norm = _norm_parameters(dims) if last and sequence_parallel and tp > 1 else 0
    kinds = ((False, dense_blocks), (True, moe_blocks))
    return final_norm + sum(count * block_kind_replicated_parameters(dims, tp, moe, sequence_parallel, ep)
                            for moe, count in kinds if count)


def largest_block_parameters(dims: GPTDims, tp: int, ep: int = 1) -> int:
    """The largest block's parameters on one rank, of the kinds the model has."""
    kinds = [moe for moe, count in ((False, dims.num_layers - dims.num_moe_blocks), (True, dims.num_moe_blocks))
             if count]
    return max(block_kind_parameters(dims, tp, moe, ep) for moe in kinds)


def embedding_parameters(dims: GPTDims, tp: int) -> int:
    """Token embedding shard plus learned positions (replicated on every TP rank)."""
    positions = dims.seq_length * dims.hidden_size if dims.position_embedding == "learned" else 0
    return dims.padded_vocab_size // tp * dims.hidden_size + positions


def pipeline_layer_parameters(dims: GPTDims, tp: int, ep: int = 1) -> list[int]:
    """Per-rank parameters of each layer of ModelSpec's list (embed | blocks | final norm | head).

    With tied embeddings the head is the embedding module again (a TiedLayerSpec), whose
    parameters DeepSpeed counts at the head's position too.
    """
    embed = embedding_parameters(dims, tp)
    per_kind = {"embed": embed, "final_norm": _norm_parameters(dims),
                "head": embed if dims.tie_embeddings else dims.padded_vocab_size // tp * dims.hidden_size}
    return [block_parameters(dims, tp, layer.block, ep) if layer.kind == "block" else per_kind[layer.kind]
            for layer in ModelSpec(dims).layers()]


def uniform_weights(dims: GPTDims) -> tuple[int, ...]:
    """PipelineModule's "type:BlockPipe" weights: 1 for a transformer block, 0 for other layers."""
    return tuple(int(layer.kind == "block") for layer in ModelSpec(dims).layers())


@lru_cache(maxsize=256)
def _cut(weights: tuple, pp: int) -> tuple:
    return tuple(partition_balanced(list(weights), pp))


def stage_bounds(dims: GPTDims, tp: int, pp: int, partition: str = "uniform") -> list[int]:
    """PipelineModule's `parts`: stage s holds layers [parts[s], parts[s+1]) of the layer list.

    "uniform" is our name for DeepSpeed's "type:BlockPipe" (balance transformer blocks),
    "parameters" balances per-rank parameter counts (backends/deepspeed/pipeline.py: PARTITION_METHODS).
    A list of pp + 1 entries: the planner itself asks for one stage at a time (_stage_range).
    """
    return [0] + [_stage_range(dims, tp, pp, stage, partition)[1] for stage in range(pp)]


# partition=parameters runs DeepSpeed's balanced partition, O(layers^2 * pp) (and DeepSpeed's own copy,
# at every start of the run, in pure Python): beyond this many layers it takes hours
PARAMETERS_PARTITION_MAX_LAYERS = 2048


def uniform_stage_range(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """What partition_balanced returns for "type:BlockPipe" weights (0, 1 x num_layers, 0, 0), for one
    stage, in O(1): the blocks split as evenly as they go, the first num_layers % pp stages one more,
    the embedding on the first stage, the final norm and head on the last (equal to the DP for every
    num_layers <= 64 and pp <= num_layers when written; tests/unit/plan/test_layer_count.py keeps a part)."""
    q, r = divmod(num_layers, pp)

    def cut(s: int) -> int:  # layer-list index where stage s starts (the embedding is layer 0)
        return 0 if s == 0 else num_layers + 3 if s == pp else 1 + s * q + min(s, r)
    return cut(stage), cut(stage + 1)


def stage_parameters(dims: GPTDims, tp: int, pp: int, stage: int, partition: str = "uniform", ep: int = 1) -> int:
    """Parameters one rank of pipeline stage `stage` holds (TP shard, this ep rank's experts; a
    tied embedding on the first and last stage is held, trained and stored by both)."""
    start, stop = _stage_range(dims, tp, pp, stage, partition, ep)
    return range_parameters(dims, tp, start, stop, ep, share_tied=True)


def range_parameters(dims: GPTDims, tp: int, start: int, stop: int, ep: int = 1, share_tied: bool = False) -> int:
    """Per-rank parameters of layers [start, stop) of ModelSpec's list (embed | blocks | final norm |
    head), counted by kind. With tied embeddings the head is the embedding module again (a
    TiedLayerSpec), whose parameters DeepSpeed counts at the head's position too; share_tied: a
    range holding both ends builds the tied module once."""
    n = dims.num_layers
    embed = embedding_parameters(dims, tp)
    head = embed if dims.tie_embeddings else dims.padded_vocab_size // tp * dims.hidden_size
    first_block, last_block = _blocks_of(dims, start, stop)
    blocks = max(0, last_block - first_block)
    moe_blocks = dims.moe_blocks_in(first_block, last_block) if blocks else 0
    held = ((blocks - moe_blocks) * block_kind_parameters(dims, tp, False, ep)
            + (moe_blocks * block_kind_parameters(dims, tp, True, ep) if moe_blocks else 0))
    held += embed if start == 0 < stop else 0
    held += _norm_parameters(dims) if start <= n + 1 < stop else 0
    if start <= n + 2 < stop:  # the head
        held += 0 if share_tied and dims.tie_embeddings and start == 0 else head
    return held


def _blocks_of(dims: GPTDims, start: int, stop: int) -> tuple[int, int]:
    """The blocks [first, last) among layers [start, stop) of ModelSpec's list (embed | blocks | final
    norm | head): layer i + 1 is block i."""
    return max(start - 1, 0), min(stop - 1, dims.num_layers)


def _stage_range(dims: GPTDims, tp: int, pp: int, stage: int, partition: str, ep: int = 1) -> tuple[int, int]:
    n = dims.num_layers
    if pp == 1:
        return 0, n + 3
    if partition == "uniform" and pp <= n:
        return uniform_stage_range(n, pp, stage)
    if n > PARAMETERS_PARTITION_MAX_LAYERS:
        raise ConfigError(f"parallel.pipeline_partition={partition} with model.num_layers={n}: the balanced partition "
                          f"takes O(layers^2 * pp) steps (hours beyond {PARAMETERS_PARTITION_MAX_LAYERS} layers, at "
                          f"every start of the run too); use parallel.pipeline_partition=uniform")
    weights = uniform_weights(dims) if partition == "uniform" else tuple(pipeline_layer_parameters(dims, tp, ep))
    parts = _cut(weights, pp)
    return parts[stage], parts[stage + 1]


def stage_expert_parameters(dims: GPTDims, tp: int, pp: int, stage: int, partition: str = "uniform",
                            ep: int = 1) -> int:
    """Of stage_parameters, the routed experts: ZeRO partitions them over the expert-data-parallel
    ranks (dp*cp/ep), the rest over dp*cp."""
    if dims.moe is None:
        return 0
    return stage_blocks(dims, tp, pp, stage, partition, moe_only=True, ep=ep) * _moe_block_expert_parameters(dims, ep)


def stage_blocks(dims: GPTDims, tp: int, pp: int, stage: int, partition: str = "uniform", moe_only: bool = False,
                 ep: int = 1) -> int:
    """Transformer blocks on a pipeline stage (moe_only: those with routed experts)."""
    first_block, last_block = _blocks_of(dims, *_stage_range(dims, tp, pp, stage, partition, ep))
    if last_block <= first_block:
        return 0
    return dims.moe_blocks_in(first_block, last_block) if moe_only else last_block - first_block


def stage_block_kinds(dims: GPTDims, tp: int, pp: int, stage: int, partition: str = "uniform",
                      ep: int = 1) -> tuple[str, ...]:
    """A stage's blocks in the model's order, "moe" or "dense" each (model.moe.layer_freq interleaves
    them), as stage_blocks cuts them: the order the optimizer meets their matrices in."""
    routed = dims.moe.is_moe_block if dims.moe else (lambda index: False)
    blocks = range(*_blocks_of(dims, *_stage_range(dims, tp, pp, stage, partition, ep)))
    return tuple("moe" if routed(i) else "dense" for i in blocks)


def stage_windowed_blocks(dims: GPTDims, lay: PlanLayout, cuts: int, stage: int) -> int:
    """Of a stage's blocks (stage of `cuts` pipeline stages), those attending through a sliding window
    shorter than the sequence (their masks are activations: plan/activations.py), counted by the
    window pattern's period, never per layer."""
    return dims.windowed_blocks_in(*_blocks_of(dims, *_stage_range(dims, lay.tp, cuts, stage, lay.partition,
                                                                   lay.grid.ep)))


def total_parameters(dims: GPTDims) -> int:
    """The whole model (tp=1, pp=1), every expert counted."""
    return stage_parameters(dims, 1, 1, 0)


def active_parameters(dims: GPTDims) -> int:
    """Parameters one token goes through: every expert but the top_k chosen ones left out of each
    MoE block (the router and shared experts are active); the total for a dense model."""
    if dims.moe is None:
        return total_parameters(dims)
    idle = (dims.moe.num_experts - dims.moe.top_k) * expert_parameters(dims)
    return total_parameters(dims) - dims.num_moe_blocks * idle


# ---- model states (ZeRO paper) ----------------------------------------------------------------

@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds on its device, and what offload moves to the host."""

    weights: float
    gradients: float
    optimizer: float
    host: float  # offloaded to CPU memory (or NVMe)
    host_ram: float = 0.0  # of host, what offload=cpu keeps in RAM (offload.*=nvme: on the drive)

    @property
    def device(self) -> float:
        return self.weights + self.gradients + self.optimizer

    def __add__(self, other: "ModelStates") -> "ModelStates":
        return ModelStates(self.weights + other.weights, self.gradients + other.gradients,
                           self.optimizer + other.optimizer, self.host + other.host, self.host_ram + other.host_ram)


def fsdp2_state_bytes(params: int, dp: int, offload: bool, state_tensors: int = 2) -> ModelStates:
    """FSDP2 holds every model state sharded over the N data-parallel ranks, in fp32 whatever the
    compute dtype (its sharded parameter is the master; bf16 is the gathered copy and gradients are
    reduced in fp32): 4Ψ/N weights + 4Ψ/N gradients + 8Ψ/N Adam moments = 16Ψ/N, with no flat
    master besides (measured at dp=4, tests/dist/test_fsdp2.py). CPU offload moves all three to the host.
    state_tensors: the optimizer's fp32 tensors per parameter (plan/optimizer.py: Muon's matrices 1)."""
    states = ModelStates(4 * params / dp, 4 * params / dp, 4 * state_tensors * params / dp, 0.0)
    return ModelStates(0.0, 0.0, 0.0, states.device, states.device) if offload else states  # RAM: FSDP2's CPU policy


def model_state_bytes(params: int, dp: int, zero_stage: int, dtype: str, offload_optimizer: str = "none",
                      offload_param: str = "none", reduces_in_backward: bool = False,
                      state_tensors: int = 2) -> ModelStates:
    """ZeRO paper: mixed-precision Adam holds 2Ψ weights + 2Ψ gradients + 12Ψ optimizer states;
    stage 1 partitions the optimizer states over the N data-parallel ranks, stage 2 also the
    gradients, stage 3 also the weights (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N). Offload moves optimizer
    states (and with ZeRO-3 optionally weights) to the host.

    fp32 training holds 4Ψ weights + 4Ψ gradients + 8Ψ (m, v), and under ZeRO DeepSpeed keeps its
    own flat fp32 partition of the weights besides the module's (4Ψ/N more; measured, the start-up
    line's "other"): 16Ψ, 8Ψ+12Ψ/N, 4Ψ+16Ψ/N, 20Ψ/N.

    Gradients are counted as a rank holds them at its memory peak. reduces_in_backward (one
    micro-batch per step, no pipeline, and DeepSpeed's gradient hooks on: contiguous_gradients or
    overlap_comm): ZeRO-1 reduces them into its partition bucket by bucket during the backward, so
    it holds Ψ/N, as ZeRO-2 does (measured: BENCHMARKS.md, planner against measured peak); with
    gradient accumulation it keeps the whole gradient between micro-batches.

    state_tensors: the optimizer's fp32 tensors per parameter, Adam's 2 (m, v) in the figures above;
    Muon's momentum alone on its matrices is 1 (plan/optimizer.py), 4 bytes less each."""
    w_bytes, g_bytes, o_bytes = STATE_BYTES[dtype]
    o_bytes += 4 * (state_tensors - 2)
    if dtype == "fp32" and zero_stage >= 1:
        o_bytes += 4  # DeepSpeed's flat fp32 partition of the weights
    weights = params * w_bytes / (dp if zero_stage >= 3 else 1)
    gradients = params * g_bytes / (dp if zero_stage >= 2 or (zero_stage == 1 and reduces_in_backward) else 1)
    optimizer = params * o_bytes / (dp if zero_stage >= 1 else 1)
    host = host_ram = 0.0
    if offload_optimizer != "none":
        host, host_ram = host + optimizer, host_ram + (optimizer if offload_optimizer == "cpu" else 0.0)
        optimizer = 0.0
    if offload_param != "none":
        host, host_ram = host + weights, host_ram + (weights if offload_param == "cpu" else 0.0)
        weights = 0.0
    return ModelStates(weights, gradients, optimizer, host, host_ram)


# each engine's MemoryTerms.states (backends/facts.py): the model states of n parameters sharded
# over `replicas` ranks of layout `lay` (in_backward: ZeRO-1 reduces into its partition in the
# backward), with `tensors` fp32 optimizer tensors per parameter
STATE_TERMS = {
    ZERO_PAPER: lambda n, replicas, lay, dtype, in_backward, tensors=2: model_state_bytes(
        n, replicas, lay.zero_stage, dtype, lay.offload_optimizer, lay.offload_param, reduces_in_backward=in_backward,
        state_tensors=tensors),
    SHARDED_FP32: lambda n, replicas, lay, dtype, in_backward, tensors=2: fsdp2_state_bytes(
        n, replicas, lay.offload_optimizer == "cpu", tensors),
}

# whether each engine's MemoryTerms.states partitions the optimizer's state over its replicas at
# layout `lay` (ZeRO from stage 1, FSDP2 always): an optimizer that needs whole matrices assembles
# them on owner ranks among those holding their parts, and its Newton-Schulz work is shared out
# over those ranks (plan/optimizer.py)
OPTIMIZER_SHARDED = {ZERO_PAPER: lambda lay: lay.zero_stage >= 1, SHARDED_FP32: lambda lay: True}
