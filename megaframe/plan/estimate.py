"""estimate(): memory per rank, FLOPs, step time and communication of one layout on one cluster.

The peak of a pipeline stage is its model states + the activations of the micro-batches 1F1B
keeps in flight on it + transient working sets (one block's activations while recomputation
rebuilds them, the last stage's logits) + the cluster's reserved runtime memory. The step time
is the model FLOPs at the assumed MFU, stretched by the pipeline bubble (p-1)/m and the forward
that full recomputation repeats (+1/3), plus communication we assume is exposed: TP and PP
transfers fully, data-parallel traffic beyond what the backward pass (2/3 of compute) hides,
and offload transfers over the host link. It ranks layouts; it is not a benchmark.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from megaframe.backends.facts import SHARD_GROUPS, ZERO_BUFFERS
from megaframe.backends.registry import engine_facts
from megaframe.config.schema import ClusterConfig, Fp8Config, OptimConfig, TrainConfig, ZeroConfig
from megaframe.config.dataset_meta import SidecarError, recorded_vocab_size
from megaframe.config.validate import ConfigError, Layout
from megaframe.model.dims import GPTDims, document_dims, resolve_dims
from megaframe.plan.activations import (ActivationShape, block_activation_bytes, fp8_cast_bytes,
                                        logits_working_bytes, moe_mlp_extra_bytes, stage_activation_bytes, tokens)
from megaframe.plan.memory import (ACTIVATION_BYTES, GIB, OPTIMIZER_SHARDED, STATE_BYTES, STATE_TERMS, ModelStates,
                                   PlanLayout, active_parameters, embedding_parameters, largest_block_parameters,
                                   stage_block_kinds, stage_blocks, stage_expert_parameters, stage_parameters,
                                   stage_replicated_parameters,
                                   stage_windowed_blocks, total_parameters)
from megaframe.plan.host import (FAST_TIER_PARTS, CheckpointCopies, HostMemory, checkpoint_copies,
                                  saved_bytes_per_parameter)
from megaframe.plan.optimizer import (ADAMW, OptimizerTerms, assembled_matrices, matrix_parameters, optimizer_terms,
                                      owner_ranks, stage_assembly_bytes, stage_matrices, stage_newton_schulz_flops,
                                      step_working_bytes)
from megaframe.parallel.pipeline_schedules import (SPLIT_BACKWARD, bubble_fraction, in_flight_micro_batches,
                                                   stage_indices)
from megaframe.tracking.flops import flops_per_token, fp8_aware_peak, fp8_flops_per_token, peak_tflops


@dataclass
class StageEstimate:
    """One pipeline stage, as any of its ranks sees it."""

    stage: int
    blocks: int
    parameters: int
    states: ModelStates
    activations_per_micro_batch: float
    in_flight: float  # micro-batches' activations held at the peak (fractions: interleaved stages)
    activations: float  # saved for backward at the 1F1B peak (in_flight micro-batches)
    working: float  # transient: recomputed block, logits, pipeline buffers, ZeRO's reduce bucket, fp8 casts
    peak: float
    # the optimizer step, after the backward (activations freed): its transient bytes (Muon's
    # exchange buffers and Newton-Schulz working set), its FLOPs on this rank and the bytes this rank
    # sends assembling split matrices (plan/optimizer.py)
    step_working: float = 0.0
    optimizer_flops: float = 0.0
    optimizer_bytes: float = 0.0
    # this rank's shard of a checkpoint: as an async save copies it (live dtypes) and as written (fp32)
    checkpoint_copy: float = 0.0
    checkpoint_file: float = 0.0


@dataclass
class Estimate:
    """What megaframe-plan prints for one layout."""

    layout: PlanLayout
    cluster: str
    total_parameters: int
    stages: list[StageEstimate]
    capacity: float  # bytes per device
    reserved: float
    peak: float
    peak_stage: int
    flops_per_step: float
    tokens_per_step: int
    # model FLOPs at the assumed MFU (None without a peak TFLOP/s), the fp8 share at the fp8 peak
    # (precision=fp8), plus the optimizer's own FLOPs on the busiest rank (Muon's Newton-Schulz)
    step_time_s: Optional[float]
    ranked_step_time_s: float  # with bubble, recomputation and exposed communication (see module doc)
    comm_bytes: dict = field(default_factory=dict)  # per rank per step: tp, pp, dp, cp, ep
    host_bytes: float = 0.0  # per rank, offloaded states
    host: Optional[HostMemory] = None  # per node: what the ranks keep in host memory (plan/host.py)
    active_parameters: int = 0  # per token: MoE leaves the unchosen experts out (= total for a dense model)
    optimizer_flops_per_rank: float = 0.0  # Muon's Newton-Schulz on the busiest stage's rank, per step
    fp8_flops_per_step: float = 0.0  # of flops_per_step, those on fp8 tensor cores (precision=fp8)

    @property
    def fits(self) -> bool:
        return self.fits_devices and (self.host is None or self.host.fits)

    @property
    def fits_devices(self) -> bool:
        return self.peak <= self.capacity

    @property
    def margin(self) -> float:
        return self.capacity - self.peak

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(fits=self.fits, fits_devices=self.fits_devices, margin=self.margin, layout=asdict(self.layout),
                 layout_text=self.layout.describe(), world_size=self.layout.world_size)
        for s, stage in zip(d["stages"], self.stages):
            s["states"]["device"] = stage.states.device
        if self.host is not None:
            d["host"].update(per_rank=self.host.per_rank, peak=self.host.peak, fits=self.host.fits)
        return d


def planning_device_type(cfg: TrainConfig) -> str:
    """Where the planned run trains, which decides its vocabulary padding (model.make_vocab_size_divisible_by
    =null): a cluster profile's GPUs, or for cluster=local this machine's device (the CPU without CUDA)."""
    if cfg.cluster.name != "local":
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def planning_vocab_size(cfg: TrainConfig) -> int:
    """The vocabulary the run will use, without opening the dataset: model.vocab_size, the
    dataset's recorded vocabulary, or the tokenizer's."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    from megaframe.data.token_files import DataError
    from megaframe.data.tokenizer import build_tokenizer

    try:
        if cfg.data.path and (recorded := recorded_vocab_size(cfg.data.path)):
            return recorded
        # a tokenizer directory that does not load (the usual way to name a Megatron dataset's) was a
        # traceback here, in megaframe-plan and megaframe-train's pre-launch check
        return build_tokenizer(cfg.data.tokenizer).vocab_size
    except (SidecarError, DataError) as err:
        raise ConfigError(" ".join(str(err).split())) from None


def host_memory_bytes() -> float:
    """This host's physical memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def local_gpu_memory() -> Optional[float]:
    """This host's GPU memory (cluster=local on a GPU machine), None without a GPU."""
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def device_capacity(cluster: ClusterConfig, ranks_on_host: int) -> float:
    """Bytes one rank may use: the cluster's GPU memory; on cluster=local this host's GPU, or
    without one its RAM shared by its ranks."""
    if cluster.memory_gb is not None:
        return cluster.memory_gb * GIB
    return local_gpu_memory() or host_memory_bytes() / max(1, ranks_on_host)


def plan_layout(cfg: TrainConfig, layout: Layout) -> PlanLayout:
    """The PlanLayout a resolved config describes."""
    return PlanLayout(grid=layout.grid, micro_batch_size=layout.micro_batch_size,
                      global_batch_size=layout.global_batch_size, zero_stage=cfg.zero.stage,
                      offload_optimizer=cfg.offload.optimizer, offload_param=cfg.offload.param,
                      recompute=cfg.parallel.activation_checkpointing,
                      sequence_parallel=cfg.parallel.sequence_parallel, partition=cfg.parallel.pipeline_partition,
                      cp_impl=cfg.parallel.cp_impl, engine=cfg.backend.name,
                      pipeline_schedule=cfg.parallel.pipeline_schedule, virtual_stages=cfg.parallel.virtual_stages)


def _ring(n: int) -> float:
    """Ring all-reduce moves 2(n-1)/n of the buffer per rank."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def rank_stages(lay: PlanLayout, stage: int) -> list[int]:
    """The pipeline stages pipeline rank `stage` runs: one, or under FSDP2's multi-stage schedules
    several (the rank's share of pp x v stages; a V-shaped schedule's rank 0 holds the first and the last)."""
    return stage_indices(lay.pipeline_schedule, lay.pp, lay.virtual_stages, stage) if lay.pp > 1 else [0]


def rank_parameters(dims: GPTDims, lay: PlanLayout, stage: int) -> int:
    """Parameters one rank of pipeline rank `stage` holds, over the stages it runs (megaframe-plan
    --dry-run builds them and compares)."""
    chunks = rank_stages(lay, stage)
    cuts = lay.pp * len(chunks)
    params = sum(stage_parameters(dims, lay.tp, cuts, c, lay.partition, lay.grid.ep) for c in chunks)
    if not engine_facts(lay.engine).memory.tied_copy_holds_positions and cuts > 1 and cuts - 1 in chunks \
            and dims.tie_embeddings and dims.position_embedding == "learned":
        # DeepSpeed's last stage holds the whole tied embedding layer; FSDP2's copy is the token table alone
        params -= dims.seq_length * dims.hidden_size
    return params


def estimate_stage(dims: GPTDims, lay: PlanLayout, dtype: str, stage: int, reserved: float,
                   host_counts_as_device: bool, zero: Optional[ZeroConfig] = None,
                   device: str = "cuda", optim: OptimizerTerms = ADAMW, fp8: Optional[Fp8Config] = None) -> StageEstimate:
    """Memory of one rank of pipeline stage `stage` (device: cuda or cpu, whose dropout kernels keep
    different tensors); zero: the DeepSpeed buffer sizes (reduce bucket, ZeRO-3's live parameters
    and prefetch bucket; None: DeepSpeed's defaults); optim: the optimizer's state and step terms
    (plan/optimizer.py); fp8: precision.fp8 (its per-matmul casts)."""
    zero = zero or ZeroConfig()
    fp8 = fp8 or Fp8Config()
    ep = lay.grid.ep
    terms = engine_facts(lay.engine).memory  # how this engine holds what (backends/facts.py)
    chunks = rank_stages(lay, stage)
    cuts = lay.pp * len(chunks)
    params = rank_parameters(dims, lay, stage)
    experts = sum(stage_expert_parameters(dims, lay.tp, cuts, c, lay.partition, ep) for c in chunks)
    # cut as the parameters are (ep: a parameter-balanced cut weighs this rank's experts)
    chunk_blocks = {c: stage_blocks(dims, lay.tp, cuts, c, lay.partition, ep=ep) for c in chunks}
    chunk_moe_blocks = {c: stage_blocks(dims, lay.tp, cuts, c, lay.partition, moe_only=True, ep=ep) for c in chunks}
    blocks = sum(chunk_blocks.values())
    # ZeRO partitions over DeepSpeed's data axis, dp x cp; a rank's experts over their replicas, dp x cp / ep
    in_backward = lay.micro_batches == 1 and lay.pp == 1 and (zero.contiguous_gradients or zero.overlap_comm)
    def states_of(n: int, replicas: int, tensors: int = 2) -> ModelStates:
        return STATE_TERMS[terms.states](n, replicas, lay, dtype, in_backward, tensors)
    replicas = lay.grid.dp_shard if terms.shards_within_replica else lay.grid.size("dp", "cp")
    moe_blocks = sum(chunk_moe_blocks.values())
    matrices = stage_matrices(dims, blocks - moe_blocks, moe_blocks, lay.tp, ep)
    row_split = matrix_parameters(matrices) - experts  # the 2D hidden matrices (experts: stacks)
    if optim.splits:  # e.g. Muon: one momentum buffer on the hidden matrices, AdamW's two on the rest
        kinds = [(params - experts - row_split, replicas, optim.other_states),
                 (row_split, replicas, optim.matrix_states)]
    else:
        kinds = [(params - experts, replicas, optim.other_states)]
    if experts:
        kinds.append((experts, lay.grid.edp, optim.matrix_states))
    states = sum((states_of(*kind) for kind in kinds[1:]), states_of(*kinds[0]))
    # a checkpoint's shard: each rank writes the range whose optimizer state it holds (a replica group's
    # first writes under HSDP), in both engines (backends/*/state_io.py)
    def saved(widened: bool) -> float:
        return sum(n / shards * saved_bytes_per_parameter(dtype, tensors, widened) for n, shards, tensors in kinds)
    shape = ActivationShape(lay.micro_batch_size, lay.tp, lay.sequence_parallel, dtype, device, lay.cp, lay.cp_impl)
    last = cuts - 1 in chunks
    per_micro = sum(stage_activation_bytes(dims, shape, chunk_blocks[c], c == 0, c == cuts - 1, lay.recompute,
                                           chunk_moe_blocks[c], stage_windowed_blocks(dims, lay, cuts, c))
                    for c in chunks)
    in_flight = in_flight_micro_batches(lay.pp, stage, lay.micro_batches, lay.pipeline_schedule, lay.virtual_stages)
    # recomputation rebuilds one block at a time: the larger of a dense and an MoE block's, of the
    # kinds this stage holds
    recomputed = block_activation_bytes(dims, shape)
    if moe_blocks:
        extra = moe_mlp_extra_bytes(dims, shape)
        recomputed += extra if moe_blocks == blocks else max(0.0, extra)
    working = recomputed if lay.recompute and blocks else 0.0
    if last:
        working += logits_working_bytes(dims, shape)
    if lay.pp > 1 and not last:  # the pipeline engine's output buffers, one per micro-batch in flight
        working += in_flight * tokens(dims, shape) * dims.hidden_size * ACTIVATION_BYTES[dtype]
    for held in UNSHARDED_TERMS[terms.unsharded](dims, lay, dtype, params, zero, blocks):
        working += held
    bucket = 0.0
    if lay.tp > 1 and terms.replicated_grad_bucket(lay.zero_stage, lay.pp > 1, dtype):
        # the fp32 bucket of the TP-replicated gradients, kept all run (held at the step too): an MoE
        # model's experts (21 GiB a rank for mixtral_8x7b at tp=4 ep=8 ZeRO-1)
        bucket = 4 * stage_replicated_parameters(dims, lay.tp, lay.sequence_parallel, blocks - moe_blocks,
                                                 moe_blocks, last, ep)
        working += bucket
    if blocks or (last and fp8.head):  # torchao's per-matmul fp8 copies of one linear
        working += fp8_cast_bytes(dims, shape, fp8)
    activations = in_flight * per_micro
    # an orthogonalising optimizer (Muon) assembles each matrix whole on one owner among the ranks
    # holding its parts (plan/optimizer.py): tp x the ranks partitioning the optimizer's matrices
    sharded = OPTIMIZER_SHARDED[terms.states](lay)
    owners = owner_ranks(lay.tp, replicas if sharded else 1, lay.grid.edp if sharded else 1)
    assembled = assembled_matrices(dims, blocks - moe_blocks, moe_blocks, lay.tp, ep) if optim.ns_steps else []
    block_kinds = [kind for c in chunks for kind in stage_block_kinds(dims, lay.tp, cuts, c, lay.partition, ep)] \
        if assembled else []
    step_working = step_working_bytes(assembled, owners, optim, block_kinds) if assembled and blocks else 0.0
    stepped = sum(n / (shards if lay.zero_stage >= 1 else 1) for n, shards, _ in kinds)  # the parameters it steps
    copied = terms.fp32_gradient_copy_at_step(lay.zero_stage, lay.pp > 1, dtype, lay.offload_optimizer != "none")
    if copied is not None:
        at_once, copy_bytes = copied
        step_working += copy_bytes * min(at_once, stepped)
    if step_working:
        step_working += bucket  # kept all run: the step holds it too
    freed = 0.0  # of the gradients the states count whole, what is gone by the step
    if terms.frees_other_gradients_at_step(lay.zero_stage) and lay.offload_optimizer == "none":
        freed = max(0.0, states.gradients - stepped * STATE_BYTES[dtype][1])
    # on this host "offloaded" states stay in the same RAM the ranks share; the optimizer step runs
    # after the backward has freed the activations
    peak = (states.device + max(activations + working, step_working - freed) + reserved
            + (states.host if host_counts_as_device else 0.0))
    return StageEstimate(stage, blocks, params, states, per_micro, in_flight, activations, working, peak,
                         step_working, stage_newton_schulz_flops(assembled, optim, owners, block_kinds),
                         stage_assembly_bytes(assembled, owners), saved(widened=False), saved(widened=True))


def zero_buffer_bytes(dims: GPTDims, lay: PlanLayout, dtype: str, params: int, zero: ZeroConfig,
                      blocks: int) -> tuple[float, ...]:
    """What DeepSpeed's ZeRO holds unsharded at its peak, besides the sharded states: its gradient
    reduce bucket from ZeRO-1 on, and at ZeRO-3 the parameters it gathers (each term on its own,
    added in this order)."""
    held = []
    if lay.zero_stage >= 1:
        # DeepSpeed's ZeRO allocates its gradient reduce bucket at full zero.reduce_bucket_size
        # (measured: 1 GB in bf16 at the default 5e8 elements, see BENCHMARKS.md)
        held.append(zero.reduce_bucket_size * STATE_BYTES[dtype][1])
    if lay.zero_stage >= 3 and lay.offload_param == "none":
        # ZeRO-3 gathers whole parameters for the forward and keeps them live up to
        # stage3_max_live_parameters, and gathers ahead through its prefetch bucket (measured: the
        # gathered weights stay resident from the forward into the backward, BENCHMARKS.md)
        prefetch = min(zero.stage3_prefetch_bucket_size, params)
        if lay.recompute and blocks:
            # recomputation replays each block's forward inside the backward, where ZeRO-3's record of
            # the module order no longer holds: it gathers on demand, about one block ahead (measured
            # on a 13M model, BENCHMARKS.md: 11 MB of the 52 MB bucket). From ~1B parameters a block
            # outweighs the default bucket and this changes nothing.
            prefetch = min(prefetch, largest_block_parameters(dims, lay.tp, lay.grid.ep))
        held.append((min(zero.stage3_max_live_parameters, params) + prefetch) * STATE_BYTES[dtype][0])
    return tuple(held)


def fsdp2_gathered_bytes(dims: GPTDims, lay: PlanLayout, dtype: str, params: int) -> float:
    """What FSDP2 holds unsharded at its peak, in the backward, besides the sharded states: the root
    group (embedding, final norm, an untied head), gathered from the forward to the end of the
    backward, and its gradients in the compute dtype, reduced only after the whole backward; at
    zero=stage3 the block in its backward and the one gathered ahead (each block resharded after its
    forward), at zero=stage2 every block (kept from its forward to its backward); and the largest
    group's gradients being reduced: in the compute dtype plus their fp32 copy that the
    reduce-scatter reads."""
    compute = ACTIVATION_BYTES[dtype]
    if lay.pp > 1:
        # torch's pipeline schedules run every backward but the step's reduction without resharding or
        # reducing (pipelining/stage.py: set_reshard_after_backward(False), set_requires_gradient_sync(False)):
        # from the first backward to the step's end the whole stage stays gathered and its gradients
        # accumulate unsharded in fp32 (measured: tests/dist/test_planner_peak.py's fsdp2 pipeline)
        return params * (compute + 4)
    block = largest_block_parameters(dims, lay.tp, lay.grid.ep)
    head = 0 if dims.tie_embeddings else dims.padded_vocab_size // lay.tp * dims.hidden_size
    root = embedding_parameters(dims, lay.tp) + head + dims.hidden_size
    gathered = params if lay.zero_stage == 2 else min(params, root + 2 * block)
    return gathered * compute + root * compute + max(block, root) * (compute + 4)


# what each engine's MemoryTerms.unsharded holds beside its sharded states, term by term
UNSHARDED_TERMS = {
    ZERO_BUFFERS: zero_buffer_bytes,
    SHARD_GROUPS: lambda dims, lay, dtype, params, zero, blocks: (fsdp2_gathered_bytes(dims, lay, dtype, params),),
}


def _stages_to_report(pp: int) -> list[int]:
    return sorted({0, pp // 2, pp - 1})


def estimate(dims: GPTDims, lay: PlanLayout, dtype: str, cluster: ClusterConfig, mfu: float,
             all_stages: bool = False, zero: Optional[ZeroConfig] = None, tf32: bool = False,
             fp8: Optional[Fp8Config] = None, optim: Optional[OptimConfig] = None,
             copies: CheckpointCopies = CheckpointCopies()) -> Estimate:
    """Memory, FLOPs, time and communication of `lay` for the model `dims` on `cluster` (tf32:
    precision.tf32, fp32 matmuls on TF32 tensor cores; fp8: precision.fp8, whose share of the FLOPs
    runs at the GPU's fp8 peak; optim: the optimizer, whose state and step the plan counts; None:
    AdamW's; copies: what the run's saves keep in host memory, counted against the node's RAM)."""
    fp8, terms = fp8 or Fp8Config(), optimizer_terms(optim)
    local = cluster.gpus_per_node is None
    ranks_on_host = lay.world_size if local else min(lay.world_size, cluster.gpus_per_node)
    capacity = device_capacity(cluster, ranks_on_host)
    reserved = cluster.reserved_gb * GIB
    # deep pipelines: the first stage (most micro-batches in flight, the embedding), a middle one and
    # the last (the logits) bound the others, which hold the same blocks with fewer in flight
    stage_ids = range(lay.pp) if all_stages or lay.pp <= 8 else _stages_to_report(lay.pp)
    # CPU ranks: offloaded states live in the same RAM
    host_is_device = local and cluster.memory_gb is None and local_gpu_memory() is None
    device = "cpu" if local and local_gpu_memory() is None else "cuda"  # the ranks of a local plan run here
    stages = [estimate_stage(dims, lay, dtype, s, reserved, host_is_device, zero, device, terms, fp8)
              for s in stage_ids]
    worst = max(stages, key=lambda st: st.peak)
    step_tokens = lay.global_batch_size * dims.seq_length
    flops = flops_per_token(dims) * step_tokens
    peak = peak_tflops(cluster.peak_tflops, dtype, cluster.gpu, this_gpu=local, tf32=tf32)
    # precision=fp8: the fp8 share of the FLOPs at the fp8 peak, the rest at `peak` (tracking/flops.py)
    model_peak = fp8_aware_peak(peak, cluster, fp8, dims, device, this_gpu=local) or peak
    # the optimizer's own FLOPs (Muon's Newton-Schulz, bf16 matmuls) on the busiest rank, at the same MFU
    optimizer_flops = max(s.optimizer_flops for s in stages)
    def model_seconds(at: float) -> float:
        return flops / (lay.world_size * at * 1e12 * mfu)
    # after the backward, on its own: not stretched by the pipeline bubble nor by recomputation
    optimizer_seconds = optimizer_flops / ((peak or 1.0) * 1e12 * mfu)
    step_time = model_seconds(model_peak) + optimizer_seconds if peak else None
    comm = communication_bytes(dims, lay, dtype, worst)
    host = host_memory(cluster, ranks_on_host, stages, worst.peak if host_is_device else None, copies)
    ranked = _ranked_step_time(lay, cluster, model_seconds(model_peak or 1.0), comm, worst) + optimizer_seconds
    return Estimate(layout=lay, cluster=cluster.name, total_parameters=total_parameters(dims), stages=stages,
                    capacity=capacity, reserved=reserved, peak=worst.peak, peak_stage=worst.stage,
                    flops_per_step=flops, tokens_per_step=step_tokens, step_time_s=step_time,
                    ranked_step_time_s=ranked, comm_bytes=comm, host_bytes=max(s.states.host for s in stages),
                    host=host,
                    active_parameters=active_parameters(dims), optimizer_flops_per_rank=optimizer_flops,
                    fp8_flops_per_step=fp8_flops_per_token(dims, fp8) * step_tokens)


def host_memory(cluster: ClusterConfig, ranks: int, stages: list[StageEstimate], device_in_ram: Optional[float],
                copies: CheckpointCopies) -> HostMemory:
    """What one node's ranks keep in its RAM (plan/host.py), the busiest stage's figures for every rank.
    device_in_ram: a rank's whole peak where its device is this RAM (it counts its offloaded states)."""
    capacity = (cluster.host_memory_gb * GIB if cluster.host_memory_gb is not None
                else host_memory_bytes() if cluster.name == "local" else None)
    return HostMemory(
        ranks=ranks,
        offloaded=max(s.states.host_ram for s in stages) if device_in_ram is None else 0.0,
        async_copies=max(s.checkpoint_copy for s in stages) if copies.async_save else 0.0,
        fast_tier=FAST_TIER_PARTS * max(s.checkpoint_file for s in stages) if copies.fast_tier else 0.0,
        device_in_ram=device_in_ram or 0.0, capacity=capacity)


def communication_bytes(dims: GPTDims, lay: PlanLayout, dtype: str, stage: StageEstimate) -> dict:
    """Bytes one rank sends per optimizer step (ring algorithms; REFERENCE.md, Pipeline and communication).

    TP: 2 all-reduces forward and 2 backward per block and micro-batch of s·b·h (SP moves the same
    volume as all-gather + reduce-scatter), more in a recomputed forward and fewer in an MoE block
    (_block_tp_units), the embedding's and the head's, the loss's three sums per token, and the sum of
    the gradients every TP rank holds whole (tests/dist/test_planner_traffic.py). PP: each micro-batch's
    activation forward and its gradient back (a first or last stage one of them), split over TP ranks
    under SP or where the engine slices them (DeepSpeed's pipe_partitioned, which gathers them over TP).
    DP: the engine's bytes a parameter a step (its facts' data_parallel_bytes), each sent (n-1)/n
    (n: the data axis dp x cp, or HSDP's shard group of dp x cp / dp_replicate ranks):
    DeepSpeed's ZeRO-0/1/2 all-reduce the gradients (two passes; ZeRO-2 after every micro-batch's
    backward), its ZeRO-3 reduce-scatters them and gathers the weights twice a micro-batch; FSDP2 under
    a pipeline reduces once a step. DP here is the data axis, dp x cp, but for experts split over ep
    ranks: edp, their traffic over their dp x cp / ep expert-data-parallel ranks.

    dp_replicas (HSDP only): a shard group's share of the gradients all-reduced across the
    dp_replicate replicas (the facts' replica_bytes), apart from DP: it crosses the slow links.

    CP, per block and micro-batch, with b the bytes of one of K or V on this rank's s/cp tokens
    (kv heads; sent in the activation dtype) and q_b those of Q: ring, (cp-1)·2b forward, again in a
    recomputed forward, and (cp-1)·2b + cp·2b backward, whose K/V gradients travel in fp32 (twice
    the bytes in bf16); Ulysses, (2·q_b + 2b)·(cp-1)/cp each way (tests/dist/test_context_parallel.py
    counts both).

    EP: the MoE all-to-alls (dispatch and combine, forward and backward) of each MoE block.

    optimizer (only where non-zero): an orthogonalising optimizer's assembly of the matrices the
    engine and tensor parallelism split, to their owners and back (plan/optimizer.py: stage_assembly_bytes).
    """
    e = ACTIVATION_BYTES[dtype]
    local = dims.seq_length // lay.cp * lay.micro_batch_size
    sbh = local * dims.hidden_size * e
    m = lay.micro_batches
    facts, chunks = engine_facts(lay.engine), rank_stages(lay, stage.stage)
    cuts = lay.pp * len(chunks)  # pipeline stages in all (several a rank under looped and V schedules)
    first, last = 0 in chunks, cuts - 1 in chunks
    recomputes = (2 if lay.pipeline_schedule in SPLIT_BACKWARD else 1) if lay.recompute else 0
    moe_blocks = sum(stage_blocks(dims, lay.tp, cuts, c, lay.partition, moe_only=True, ep=lay.grid.ep)
                     for c in chunks)
    units = {kind: _block_tp_units(kind, dims, lay.sequence_parallel, recomputes) for kind in ("dense", "moe")}
    tp = m * ((stage.blocks - moe_blocks) * units["dense"] + moe_blocks * units["moe"]) * _ring(lay.tp) * sbh
    if first:  # the vocabulary-parallel embedding's all-reduce (SP: and the gather back through its scatter)
        tp += m * (1.5 if lay.sequence_parallel else 1.0) * _ring(lay.tp) * sbh
    if last:  # the head's input gradient; the vocabulary-parallel loss's 3 fp32 sums
        tp += m * _ring(lay.tp) * (sbh + 3 * local * 4)
    if lay.pp > 1 and not lay.sequence_parallel and facts.pipeline_gathers_tp_slices:
        # an activation's slices gathered on arrival, and a gradient's with the stage's own output for the backward
        tp += m * ((0 if first else 1) + (0 if last else 2)) * _ring(lay.tp) / 2 * sbh
    if lay.tp > 1:  # the gradients of what every TP rank holds whole (norms under SP, an MoE block's experts)
        replicated = stage_replicated_parameters(dims, lay.tp, lay.sequence_parallel, stage.blocks - moe_blocks,
                                                 moe_blocks, last, lay.grid.ep)
        # summed once a step in an fp32 bucket where the engine leaves gradients in .grad, else at each use
        bucket = facts.memory.replicated_grad_bucket(lay.zero_stage, lay.pp > 1, dtype)
        tp += _ring(lay.tp) * replicated * (4 if bucket else m * e)
    # each of the rank's stages sends a micro-batch's activation on (but the model's last) and its
    # gradient back (but the first), unless the next (previous) stage is its own (a V schedule's turn);
    # under SP, or sliced by the engine, 1/tp of it from each TP rank
    sends = sum((c != cuts - 1 and c + 1 not in chunks) + (c != 0 and c - 1 not in chunks) for c in chunks)
    pp = sends * m * sbh / (lay.tp if lay.sequence_parallel or facts.pipeline_gathers_tp_slices else 1)
    replicas = lay.grid.dp_replicate
    shard_ranks = lay.dp * lay.cp // replicas  # the data axis, or HSDP's shard group
    # experts split over ep ranks are reduced (and sharded) over their expert-data-parallel ranks alone
    experts = sum(stage_expert_parameters(dims, lay.tp, cuts, c, lay.partition, lay.grid.ep)
                  for c in chunks) if lay.grid.ep > 1 else 0
    dense = stage.parameters - experts
    per_parameter = facts.data_parallel_bytes(lay.zero_stage, lay.pp > 1, m, dtype)
    dp = _ring(shard_ranks) / 2 * dense * per_parameter  # (n-1)/n of the group's parameters
    edp = _ring(lay.grid.edp) / 2 * experts * per_parameter
    cp = 0.0
    if lay.cp > 1:
        kv_heads = dims.num_kv_heads // lay.tp if dims.num_kv_heads % lay.tp == 0 else dims.num_kv_heads
        b = local * kv_heads * dims.head_dim * e
        q_b = local * dims.num_heads // lay.tp * dims.head_dim * e
        if lay.cp_impl == "ring":
            forwards = 1 + recomputes
            per_block = (lay.cp - 1) * 2 * b * (forwards + 1) + lay.cp * 2 * b * 4 / e
        else:
            per_block = (2 * q_b + 2 * b) * (lay.cp - 1) / lay.cp * (2 + recomputes)
        cp = stage.blocks * m * per_block
    ep = 0.0
    if lay.grid.ep > 1:
        # each MoE block and micro-batch: tokens to their experts' ranks and back, forward and
        # backward (again in a recomputed forward); a rank sends (ep-1)/ep of its top_k copies. Each
        # TP rank routes 1/tp of the tokens.
        sent = local / lay.tp * dims.moe.top_k * dims.hidden_size * e * (lay.grid.ep - 1) / lay.grid.ep
        ep = moe_blocks * m * sent * (4 + 2 * recomputes)
    sent = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
    if experts:  # their reduction spans the data axis (every ep-th rank), HSDP's shard group or not
        sent["edp"] = edp
    if replicas > 1:  # HSDP: each rank's shard of the gradients, all-reduced across the replicas
        sent["dp_replicas"] = _ring(replicas) / 2 * dense / shard_ranks * facts.replica_bytes
    if stage.optimizer_bytes:  # Muon: matrices to their owners and back (plan/optimizer.py)
        sent["optimizer"] = stage.optimizer_bytes
    return sent


def _block_tp_units(kind: str, dims: GPTDims, sp: bool, recomputes: int) -> float:
    """A block's TP traffic a micro-batch, in all-reduces of s·b·h (SP: an all-gather and a
    reduce-scatter each). Dense: attention and MLP, each one forward and one backward. A recomputed
    forward (torch's non-reentrant checkpoint) stops after the last tensor backward needs: before the
    MLP's closing reduction (one more all-reduce; 1.5 under SP, whose all-gather into the MLP reruns),
    after it with dropout, whose mask is saved there (two). `recomputes`: 0, 1, or 2 under a
    split-backward schedule (input and weight gradients recompute apart). An MoE block's routed
    experts take 1/tp of the tokens (a split) and all-gather their outputs, half an all-reduce each
    way (nothing under SP: they take the sequence shard as it is); its shared experts are an MLP,
    after them, whose saved tensors make a recomputed forward rerun the experts' gather."""
    dropout = dims.dropout > 0
    if kind == "dense":
        return 4 + recomputes * (2.0 if dropout else 1.5 if sp else 1.0)
    shared = dims.moe is not None and dims.moe.shared_experts > 0
    routed = 0.0 if sp else 1.0
    routed_rerun = 0.0 if sp else 0.5 if (dropout or shared) else 0.0
    shared_rerun = ((0.5 if sp else 0.0) + ((0.5 if sp else 1.0) if dropout else 0.0)) if shared else 0.0
    return 2 + routed + (2.0 if shared else 0.0) + recomputes * (1 + routed_rerun + shared_rerun)


def _ranked_step_time(lay: PlanLayout, cluster: ClusterConfig, compute: float, comm: dict,
                      stage: StageEstimate) -> float:
    """Seconds per step used to rank layouts (module docstring)."""
    gpn = cluster.gpus_per_node or lay.world_size
    bubble = bubble_fraction(lay.pipeline_schedule, lay.pp, lay.micro_batches, lay.virtual_stages)
    compute = compute * (1 + bubble) * (4 / 3 if lay.recompute else 1.0)
    gbps = 1e9
    tp_bw = cluster.intra_node_gbps if lay.tp <= gpn else cluster.inter_node_gbps
    # pp is the outermost axis: a stage's peer is tp x dp x cp ranks away, on another node once the world spans two
    pp_bw = cluster.intra_node_gbps if lay.world_size <= gpn else cluster.inter_node_gbps
    # a stage's data axis is its tp x dp x cp neighbouring ranks (parallel/dims.py); HSDP's shard group
    # is the fast run of them, tp x dp x cp / dp_replicate, its replicas span the axis
    data_ranks = lay.tp * lay.dp * lay.cp
    replica_bw = cluster.intra_node_gbps if data_ranks <= gpn else cluster.inter_node_gbps
    dp_bw = cluster.intra_node_gbps if data_ranks // lay.grid.dp_replicate <= gpn else cluster.inter_node_gbps
    cp_bw = cluster.intra_node_gbps if lay.tp * lay.cp <= gpn else cluster.inter_node_gbps
    exposed = comm["tp"] / (tp_bw * gbps) + comm["pp"] / (pp_bw * gbps)
    spanning = comm.get("dp_replicas", 0.0) + comm.get("edp", 0.0)  # across the whole data axis
    data_parallel = comm["dp"] / (dp_bw * gbps) + spanning / (replica_bw * gbps)
    exposed += max(0.0, data_parallel - compute * 2 / 3)
    # counted as exposed in full (conservative): the ring overlaps each hop with a block's compute,
    # but how much it hides depends on the attention kernel, which the planner does not model
    exposed += comm.get("cp", 0.0) / (cp_bw * gbps)
    # an ep group spans tp*ep neighbouring ranks; all-to-alls sit between the expert GEMMs: exposed
    ep_bw = cluster.intra_node_gbps if lay.tp * lay.grid.ep <= gpn else cluster.inter_node_gbps
    exposed += comm.get("ep", 0.0) / (ep_bw * gbps)
    # the optimizer's exchanges (Muon's assembly) run in the optimizer step, after the backward: exposed
    exposed += comm.get("optimizer", 0.0) / (replica_bw * gbps)
    if lay.offload_optimizer != "none" or lay.offload_param != "none":
        # gradients to the host and updated weights back, every step
        exposed += stage.parameters * 4 / (cluster.host_gbps * gbps)
    return compute + exposed


# a model beyond any machine: 10**15 parameters hold 16 PB of model states (16 bytes each, the ZeRO
# paper's mixed-precision Adam), twice the memory of 10**5 H100s together (8 PB); gpt_1t is 10**12
MAX_PARAMETERS = 10**15


def planning_dims(cfg: TrainConfig, layout: Layout) -> GPTDims:
    """The model's dimensions as the planner sees them; ConfigError for a model beyond MAX_PARAMETERS."""
    dims = resolve_dims(cfg.model, planning_vocab_size(cfg), tp=layout.tp, device_type=planning_device_type(cfg))
    if (count := total_parameters(dims)) > MAX_PARAMETERS:
        raise ConfigError(f"the model has {count:.3g} parameters (model.num_layers={dims.num_layers}, "
                          f"model.hidden_size={dims.hidden_size}): beyond 1e15, whose model states (16 bytes each) "
                          f"outgrow the memory of 10**5 GPUs together; check the model's sizes for a typo")
    return document_dims(dims, cfg.data, None)  # data.document_mask: its masks (plan/activations.py)


def estimate_config(cfg: TrainConfig, layout: Layout, all_stages: bool = False) -> Estimate:
    """estimate() for a composed, validated config; ConfigError for a model beyond MAX_PARAMETERS."""
    dims = planning_dims(cfg, layout)
    return estimate(dims, plan_layout(cfg, layout), cfg.precision.dtype, cfg.cluster, cfg.plan.mfu, all_stages,
                    cfg.zero, cfg.precision.tf32, cfg.precision.fp8, cfg.optim, checkpoint_copies(cfg))
