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
