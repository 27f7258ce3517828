"""DeepSpeed as megaframe's registry sees it (backends/registry.py). Every entry imports its module
when called: importing this file imports no DeepSpeed."""
from __future__ import annotations

import math
from typing import Optional

from megaframe.backends.facts import ZERO_BUFFERS, ZERO_PAPER, EngineFacts, MemoryTerms
from megaframe.backends.registry import lazy_plug


def replicated_grad_bucket(zero_stage: int, pipelined: bool, dtype: str) -> bool:
    """Where DeepSpeed leaves gradients in .grad until the accumulation boundary, so one bucket can
    sum the TP-replicated ones before it reads them (engine.py): ZeRO-0/1, except the pipeline's bf16
    ZeRO-0 optimizer, which moves them to fp32 after every micro-batch. ZeRO-2/3 reduce each gradient
    inside the backward pass, so there the sum stays at each use."""
    return zero_stage <= 1 and not (pipelined and zero_stage == 0 and dtype == "bf16")


# ZeRO-3 steps its partition a sub-group at a time: DeepSpeed's sub_group_size, which megaframe leaves
# at its default
ZERO3_SUB_GROUP = 1e9


def fp32_gradient_copy_at_step(zero_stage: int, pipelined: bool, dtype: str,
                               offloaded: bool) -> Optional[tuple[float, float]]:
    """The copy of the gradients DeepSpeed's step runs on, beside the gradients it holds, as (the most
    elements copied at once, bytes an element). ZeRO-1/2 flatten the partition's gradients into a new
    tensor and step on it (stage_1_and_2.py: flat_grad_partition), cast to fp32 in bf16 or fp16
    (single_grad_partition), the 16-bit flat copy and its cast both held at the cast: 4 bytes a
    parameter over N in fp32, 2 + 4 in bf16 or fp16 (with the cast alone, ZeRO-2 in bf16 peaked 11%
    above the plan at dp=2; without the flat copy, 15% in fp32: tests/dist/test_planner_peak.py).
    ZeRO-3 does the same a sub-group of its partition at a time (stage3.py:
    _prepare_fp32_grad_for_sub_group). At ZeRO-0 in bf16 or fp16 its FP16 optimizers (fp16 pipelines
    too) flatten (fused) or cast (unfused) every gradient, 20 bytes a parameter at the step, not the
    ZeRO paper's 16. None with the optimizer offloaded (the copy is on the host), at ZeRO-0 in fp32
    (torch's optimizer steps the gradients in place), and for the pipeline's bf16 ZeRO-0 optimizer,
    which accumulates its own gradients (the plan's 16 bytes a parameter were measured within 8% there)."""
    if offloaded:
        return None
    if zero_stage >= 1:
        return (ZERO3_SUB_GROUP if zero_stage == 3 else math.inf), 4.0 if dtype == "fp32" else 6.0
    if dtype == "fp32" or (pipelined and dtype == "bf16"):
        return None
    return math.inf, 4.0


def data_parallel_bytes(zero_stage: int, pipelined: bool, micro_batches: int, dtype: str) -> float:
    """DeepSpeed's traffic over the data axis, bytes a parameter a step (gradients and weights both in
    the compute dtype; counted on gloo ranks: tests/dist/test_planner_dp_traffic.py). Its gradient
    reductions are all-reduces, two passes each: ZeRO-0 and ZeRO-1 once a step, ZeRO-2 after every
    micro-batch's backward (ZeRO-1 and -2 all-reduce their buckets, use_multi_rank_bucket_allreduce,
    on by default, where a reduce-scatter would do); ZeRO-1 and -2 then all-gather the updated
    weights, and so does the pipeline's bf16 ZeRO-0 optimizer, which partitions its fp32 masters
    (bf16_optimizer.py: update_lp_params). ZeRO-3 reduce-scatters the gradients after every
    micro-batch and gathers the weights in every forward and backward: an upper bound, as it keeps
    parameters resident up to stage3_max_live_parameters (1.5x over on a 6.5M-parameter model)."""
    m, width = micro_batches, (4 if dtype == "fp32" else 2)
    pipeline_bf16 = pipelined and dtype == "bf16"
    gradient_passes, weight_passes = {0: (2, 1 if pipeline_bf16 else 0), 1: (2, 1), 2: (2 * m, 1)}.get(
        zero_stage, (m, 2 * m))
    return width * (gradient_passes + weight_passes)


FACTS = EngineFacts(
    zero_stages=(0, 1, 2, 3), pipeline_zero_stages=(0, 1),  # its pipeline engine: ZeRO 0-1 (rules.py)
    per_module_gather_stages=(3,), param_offload_stages=(3,),
    pipeline_schedules=(("1f1b", 1),), schedules_need_micro_batches=False,  # its 1F1B takes any count
    split_backward_zero_stages=(),
    # its fp32 masters (and under ZeRO at fp32 a flat partition) by stage; a pipeline's tied embedding
    # is the TiedLayerSpec's whole module on both ends
    memory=MemoryTerms(states=ZERO_PAPER, unsharded=ZERO_BUFFERS, shards_within_replica=False,
                       tied_copy_holds_positions=True, replicated_grad_bucket=replicated_grad_bucket,
                       fp32_gradient_copy_at_step=fp32_gradient_copy_at_step,
                       # ZeRO-1 reduces into its partition at the accumulation boundary and frees the
                       # other gradients before it steps (stage_1_and_2.py: free_grad_in_param_list)
                       frees_other_gradients_at_step=lambda zero_stage: zero_stage == 1),
    data_parallel_bytes=data_parallel_bytes,
    described_partition_stages=(1, 2, 3),  # ZeRO-1/2/3's flat partitions, for Muon (muon_zero.py)
    nvme_offload_stages=(3,),  # ZeRO-Infinity (conf/offload/nvme.yaml swaps the parameters too)
    # pipe_partitioned and grad_partitioned, off under SP (ds_config.py)
    pipeline_gathers_tp_slices=True)

PLUG = lazy_plug("deepspeed", FACTS, build="engine:DeepSpeedBackend", init_distributed="engine:init_distributed",
                 device_type="accelerator:device_type",
                 device_supports_fp16="accelerator:device_supports_fp16",
                 device_supports_bf16="accelerator:device_supports_bf16",
                 system_problem="system:system_problem", expert_parallel_problem="system:expert_parallel_problem",
                 stage_boundaries="pipeline:stage_boundaries", config_problem="rules:config_problem", layout_problem="rules:layout_problem",
                 config_warnings="rules:config_warnings", meta_stages="meta_stages:meta_stages")
