"""The DeepSpeed backend: the only package in megaframe that imports deepspeed.

plug.py        what the registry (backends/registry.py) hands the rest of megaframe
engine.py      DeepSpeedBackend (build, steps, state) and init_distributed
ds_config.py   TrainConfig -> DeepSpeed's JSON
pipeline.py    the GPT as a PipelineModule; DeepSpeed's stage partitioning
topology.py    ParallelDims as DeepSpeed's topology and Megatron's mpu
state_io.py    full (layout-free) state out of and into a running engine
memory.py      the model states an engine holds, by role
nvme.py        per-process NVMe swap folders
build_locks.py stale JIT build locks; one_unit.py each op's torch-including sources in one unit
accelerator.py what the device supports (asked before launch)
rules.py       DeepSpeed's config rules, handed to validation; compat.py the table they make
experts.py     expert parallelism as DeepSpeed's engine sees it, and its marks on expert shards
zero_init.py   ZeRO-3 models built partitioned
system.py      what offload needs of this machine; skip_gate.py, overflow.py, muon_import.py
"""
import logging as _logging


class _NoLineTheUserCannotActOn(_logging.Filter):
    """Two of DeepSpeed's lines, dropped from its logger (by name, before DeepSpeed is imported: it
    logs while importing):
    - Without a CUDA device DeepSpeed falls back to its CPU accelerator and says so on every rank
      ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
      it."): the start-up line names the device already. Not avoided by setting DS_ACCELERATOR: the
      environment of the process that submits a SLURM or Ray job travels with the job, and would put
      a GPU cluster's ranks on their CPUs.
    - "**** You are using ZeRO with an untested optimizer, proceed with caution *****": DeepSpeed
      knows only its own optimizer classes; the only other one megaframe hands it is its Muon, whose
      steps under ZeRO-1/2/3 megaframe's tests compare with the single-rank run (tests/dist/
      test_muon_zero.py), so the warning told a user of optim=muon to worry about nothing."""

    DROPPED = ("Setting accelerator to CPU.", "**** You are using ZeRO with an untested optimizer")

    def filter(self, record: _logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.DROPPED)


_logging.getLogger("DeepSpeed").addFilter(_NoLineTheUserCannotActOn())
