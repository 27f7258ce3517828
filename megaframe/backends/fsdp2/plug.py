"""FSDP2 as megaframe's registry sees it (backends/registry.py). Every entry imports its module when
called: asking for the plug or refusing a config imports no torch.distributed.fsdp."""
from __future__ import annotations

from megaframe.backends.facts import SHARD_GROUPS, SHARDED_FP32, EngineFacts, MemoryTerms
from megaframe.backends.registry import lazy_plug


def fsdp2_traffic(zero_stage: int, pipelined: bool, micro_batches: int, dtype: str) -> float:
    """FSDP2's traffic over the data axis (HSDP's shard group), bytes a parameter a step (counted on gloo ranks:
    tests/dist/test_planner_dp_traffic.py). Alone it reduce-scatters the gradients after every
    micro-batch's backward and gathers the blocks in every forward, at zero=stage3 in every backward
    too (resharded after the forward). Under torch's pipeline schedules the gradients are reduced once,
    after the last backward, and a backward leaves the stage gathered (pipelining/stage.py): at stage3
    every forward still reshards it, so each backward and each forward after a forward gathers it
    again, about m + 1 times a step; at stage2, once a step. The root module (embedding, final norm,
    head) is gathered once a micro-batch alone and once a step under a pipeline: counted as a block,
    an over-count where it is a large part of the stage. Weights travel in the compute dtype,
    gradients in fp32 (build.py: reduce_dtype)."""
    m = micro_batches
    if pipelined:
        gradient_passes, weight_passes = 1, (m + 1 if zero_stage == 3 else 1)
    else:
        gradient_passes, weight_passes = m, (2 * m if zero_stage == 3 else m)
    return 4 * gradient_passes + (4 if dtype == "fp32" else 2) * weight_passes


# what rules.py refuses, as the layout search needs it (tests/unit/backends/test_facts.py checks the two agree)
FACTS = EngineFacts(
    zero_stages=(2, 3), pipeline_zero_stages=(2, 3), per_module_gather_stages=(2, 3), param_offload_stages=(),
    pipeline_schedules=(("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)), schedules_need_micro_batches=True,
    split_backward_zero_stages=(2,),
    # fp32 shards are the masters; HSDP shards within a replica; a pipeline's last stage ties the token table alone
    memory=MemoryTerms(states=SHARDED_FP32, unsharded=SHARD_GROUPS, shards_within_replica=True,
                       tied_copy_holds_positions=False),
    data_parallel_bytes=fsdp2_traffic,
    # HSDP all-reduces each shard's fp32 gradient across the replicas once a step: after the last
    # micro-batch alone (engine.py: set_requires_all_reduce), after the last backward under a pipeline
    replica_bytes=2 * 4,
    optimizer_on_tensors=True)  # torch's optimizer on the DTensor shards

PLUG = lazy_plug("fsdp2", FACTS, build="engine:Fsdp2Backend", init_distributed="engine:init_distributed", device_type="engine:device_type",
                 device_supports_fp16="engine:device_supports_fp16", device_supports_bf16="engine:device_supports_bf16",
                 system_problem="rules:system_problem", expert_parallel_problem="rules:expert_parallel_problem",
                 stage_boundaries="rules:stage_boundaries", config_problem="rules:config_problem", layout_problem="rules:layout_problem",
                 config_warnings="rules:config_warnings", meta_stages="meta_stages:meta_stages")
