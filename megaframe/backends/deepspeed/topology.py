"""ParallelDims as DeepSpeed sees it: the pipeline engine's topology and Megatron's `mpu` object.

Both are adapters built from ParallelDims/ParallelState, never the other way round. DeepSpeed knows
three axes, pipe, data and model (model fastest), which is ParallelDims' layout with dp x cp as
DeepSpeed's "data" axis: DeepSpeed uses that axis to reduce gradients and partition ZeRO states,
and that is what dp x cp is for.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.state import ParallelState


def build_topology(grid: ParallelDims) -> PipeModelDataParallelTopology:
    """The topology PipelineModule takes, with the same rank layout as `grid`. Expert parallelism
    adds no axis: its ep and edp groups are a view of the data axis (backends/deepspeed/experts.py)."""
    return PipeModelDataParallelTopology(num_pp=grid.pp, num_mp=grid.tp, num_dp=grid.dp * grid.cp)


class MegatronMpu:
    """The Megatron `mpu` interface deepspeed.initialize(mpu=...) reads, over a ParallelState."""

    def __init__(self, ps: ParallelState):
        self.ps = ps

    def get_model_parallel_rank(self) -> int:
        return self.ps.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ps.tp

    def get_model_parallel_group(self):
        return self.ps.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ps.group_ranks("tp")[0]

    # DeepSpeed's "data parallel" is where gradients are reduced and ZeRO partitions: dp x cp
    def get_data_parallel_rank(self) -> int:
        return self.ps.group_ranks("dp", "cp").index(self.ps.rank)

    def get_data_parallel_world_size(self) -> int:
        return self.ps.grid.size("dp", "cp")

    def get_data_parallel_group(self):
        return self.ps.grad_reduce_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.ps.group_ranks("dp", "cp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.ps.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ps.pp

    def get_pipeline_model_parallel_group(self):
        return self.ps.pp_group
