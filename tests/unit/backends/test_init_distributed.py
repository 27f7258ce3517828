"""Joining the process group on CPU builds no DeepSpeed op that training does not use."""
from __future__ import annotations

import subprocess
import sys

from tests.support.helpers import REPO, assert_ok, cli_env

PROBE = """
from megaframe.backends.deepspeed.engine import init_distributed
import deepspeed.comm.comm as ds_comm
import torch.distributed as dist
init_distributed()
print("world", dist.get_world_size(), "shm op", ds_comm.cdb.shm_comm_op)
"""


def test_cpu_process_group_skips_the_shared_memory_inference_op(tmp_path):
    """DeepSpeed would JIT-build its shm all-reduce (45 s cold) for inference_all_reduce only."""
    extensions = tmp_path / "extensions"  # empty: any op load would have to build here
    env = cli_env(TORCH_EXTENSIONS_DIR=str(extensions), DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert_ok(result)
    assert "world 1 shm op None" in result.stdout
    assert not extensions.exists() or not any(extensions.rglob("*shm*"))


NOT_CPU = """
import os
from deepspeed.accelerator import set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

class Elsewhere(CPU_Accelerator):
    # an accelerator that is not called "cpu" (as CUDA is not), with gloo underneath, one visible device
    def device_name(self, device_index=None):
        return "elsewhere"
    def device_count(self):
        return 1
    def set_device(self, device_index):
        print("set_device", device_index)

set_accelerator(Elsewhere())
from deepspeed import ops
ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as on CUDA, where DeepSpeed has no such op to build
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29513")
from megaframe.backends.deepspeed.engine import init_distributed
import torch.distributed as dist
init_distributed()
print("world", dist.get_world_size(), "LOCAL_RANK", os.environ["LOCAL_RANK"])
"""


def test_an_accelerator_other_than_the_cpu_joins_and_drives_a_device_it_sees(tmp_path):
    """The branch CUDA takes (no CPU-only op switch): it once died of UnboundLocalError. The rank is
    local rank 3 of its node but sees one device (SLURM --gpus-per-task, Ray): it drives device 0, and
    so does DeepSpeed, which takes LOCAL_RANK for the ordinal (engine, zero.Init, PipelineModule)."""
    env = cli_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"), DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, "-c", NOT_CPU], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert_ok(result)
    assert "set_device 0" in result.stdout and "world 1 LOCAL_RANK 0" in result.stdout, result.stdout


def test_each_rank_takes_its_share_of_the_devices_it_sees():
    from megaframe.backends.common import local_device_index

    assert [local_device_index(rank, 8) for rank in (0, 7)] == [0, 7]  # torchrun: all 8 visible
    assert [local_device_index(rank, 1) for rank in (0, 3, 7)] == [0, 0, 0]  # one bound GPU per task
    assert [local_device_index(rank, 2) for rank in (2, 3)] == [0, 1]  # two per task
    assert local_device_index(5, 0) == 5  # no device count (CPU): unchanged
