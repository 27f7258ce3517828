"""What the planner and validation know of an engine, as data: the ZeRO stages and pipeline
schedules it runs, what a whole-model graph cannot cross, and how it holds a rank's memory, in the
planner's terms. Each engine's plug.py holds one EngineFacts and the registry hands it out
(registry.engine_facts); plan/ and config/validate.py read it instead of comparing the engine's
name (tests/unit/test_architecture.py holds them to that), so a third engine states its facts in
its own folder. Pure data: nothing here imports torch or an engine library, so the planner's search
over thousands of layouts, and a refused config, stay cheap."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

# How an engine holds a rank's model states (plan/memory.py: STATE_TERMS holds each formula)
ZERO_PAPER = "zero_paper"  # by ZeRO stage (1: optimizer states sharded, 2: gradients too, 3: weights too)
SHARDED_FP32 = "sharded_fp32"  # weights, gradients and Adam moments sharded in fp32 at any stage; offload moves all
# What it holds unsharded beside them at its peak (plan/estimate.py: UNSHARDED_TERMS)
ZERO_BUFFERS = "zero_buffers"  # ZeRO's reduce bucket from stage 1; ZeRO-3's live parameters and prefetch bucket
SHARD_GROUPS = "shard_groups"  # the root group and the blocks gathered in flight, gradients reduced per group


@dataclass(frozen=True)
class MemoryTerms:
    """How the engine's memory is counted (plan/estimate.py): the formulas it follows and the
    choices that differ between engines."""

    states: str  # ZERO_PAPER | SHARDED_FP32
    unsharded: str  # ZERO_BUFFERS | SHARD_GROUPS
    shards_within_replica: bool  # HSDP: states shard over one replica's ranks, not over all of dp x cp
    # a tied embedding under a pipeline: the last stage's copy is the whole embedding layer (learned
    # positions too), not the token table alone
    tied_copy_holds_positions: bool
    # whether, at tp > 1, it sums the gradients of the parameters every TP rank holds whole (an MoE
    # block's experts and router, norms under sequence parallelism) in one fp32 buffer kept for the
    # whole run (parallel/grad_bucket.py), as f(zero stage, pipelined, precision.dtype)
    replicated_grad_bucket: Callable[[int, bool, str], bool] = lambda zero_stage, pipelined, dtype: False
    # whether its optimizer step runs on an fp32 copy of the gradients it steps (at ZeRO >= 1 its
    # partition's) made on the device while the ones it holds are still there, on top of the states:
    # (the most elements one copy holds (inf: all it steps), bytes an element copied (4, or 6 with a
    # 16-bit flat copy on the way)), or None without one, as f(zero stage, pipelined, precision.dtype,
    # optimizer offloaded)
    fp32_gradient_copy_at_step: Callable[[int, bool, str, bool], Optional[tuple[float, float]]] = \
        lambda stage, pipelined, dtype, off: None
    # whether, at this ZeRO stage, it has reduced the gradients into the partition it steps and freed the
    # rest before its step, where its states count them whole (at the backward's peak)
    frees_other_gradients_at_step: Callable[[int], bool] = lambda zero_stage: False


@dataclass(frozen=True)
class EngineFacts:
    """What an engine runs, for the layout search and validation (its refusals, with their
    messages, stay its rules: plug.config_problem / layout_problem)."""

    zero_stages: tuple[int, ...]  # the ZeRO stages it runs without a pipeline
    pipeline_zero_stages: tuple[int, ...]  # ... and with parallel.pp > 1
    # stages whose parameters are gathered module by module: a whole-model graph (train.compile_scope=
    # model) cannot run across them
    per_module_gather_stages: tuple[int, ...]
    # stages at which parameters offload on their own (offload.param=cpu with offload.optimizer=none runs)
    param_offload_stages: tuple[int, ...]
    pipeline_schedules: tuple[tuple[str, int], ...]  # (parallel.pipeline_schedule, virtual_stages) the search tries
    schedules_need_micro_batches: bool  # its pipeline refuses a micro-batch count its schedule cannot run
    split_backward_zero_stages: tuple[int, ...]  # stages a split-backward schedule (zbv, ...) runs at
    memory: MemoryTerms
    # what a step moves of each parameter over the data axis, in bytes a parameter (each sent (n-1)/n
    # from a rank: ring), as f(zero stage, pipelined, micro-batches, precision.dtype): the planner's DP traffic
    data_parallel_bytes: Callable[[int, bool, int, str], float]
    # HSDP (parallel.dp_replicate > 1): what a step all-reduces across the replicas, in bytes a parameter
    # of the shard group's share (both passes of the all-reduce); 0 for an engine without replicas
    replica_bytes: float = 0.0
    # its optimizer steps each parameter's own tensor (whole, or a DTensor's row shard), not flat
    # partitions of many: an optimizer that needs a parameter's shape (Muon: optim/rules.py) runs on it
    optimizer_on_tensors: bool = False
    # the ZeRO stages whose flat partitions it describes to the optimizer (where each matrix lies in
    # each rank's partition: optim/sharded.py's FlatPartition), so Muon assembles matrices from them
    described_partition_stages: tuple[int, ...] = ()
    # the ZeRO stages at which it swaps optimizer states and parameters to NVMe (offload=nvme)
    nvme_offload_stages: tuple[int, ...] = ()
    # its pipeline sends each TP rank's 1/tp slice of a replicated activation (or gradient) and
    # all-gathers it over TP on arrival, and gathers a stage's own output again for its backward
    pipeline_gathers_tp_slices: bool = False


@dataclass(frozen=True)
class MetaStages:
    """One pipeline rank's share of a model as its engine builds it, on the meta device and without
    process groups (the plug's meta_stages: megaframe-plan --dry-run)."""

    stages: tuple[int, ...]  # the pipeline stages this rank runs (several under looped and V schedules)
    layers: tuple[int, ...]  # what they hold: indices into ModelSpec's layer list, stage by stage
    parameters: int  # the parameters the built modules hold on this rank
