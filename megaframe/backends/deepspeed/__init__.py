"""The DeepSpeed backend: the only package in megaframe that imports deepspeed.

plug.py        what the registry (backends/registry.py) hands the rest of megaframe
engine.py      DeepSpeedBackend (build, steps, state) and init_distributed
ds_config.py   TrainConfig -> DeepSpeed's JSON
pipeline.py    the GPT as a PipelineModule; DeepSpeed's stage partitioning
topology.py    ParallelDims as DeepSpeed's topology and Megatron's mpu
state_io.py    full (layout-free) state out of and into a running engine
memory.py      the model states an engine holds, by role
nvme.py        per-process NVMe swap folders
build_locks.py stale JIT build locks
accelerator.py what the device supports (asked before launch)
rules.py       DeepSpeed's config rules, handed to validation; compat.py the table they make
experts.py     expert parallelism as DeepSpeed's engine sees it, and its marks on expert shards
zero_init.py   ZeRO-3 models built partitioned
system.py      what offload needs of this machine; skip_gate.py, overflow.py, muon_import.py
"""
import os as _os


def _choose_cpu_accelerator_quietly() -> None:
    """Without a CUDA device DeepSpeed falls back to its CPU accelerator and says so on every rank
    ("Setting accelerator to CPU. If you have GPU ..."), a line the user cannot act on. Naming the
    CPU ourselves (DS_ACCELERATOR, inherited by the ranks) is the same choice without the line. A
    DS_ACCELERATOR the user set is kept; megaframe trains on CUDA or the CPU, so no other
    accelerator DeepSpeed could detect is lost."""
    if "DS_ACCELERATOR" not in _os.environ:
        import torch

        if not torch.cuda.is_available():
            _os.environ["DS_ACCELERATOR"] = "cpu"


_choose_cpu_accelerator_quietly()
