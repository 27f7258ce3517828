"""Joining the process group on CPU builds no DeepSpeed op that training does not use."""
from __future__ import annotations

import subprocess
import sys

from helpers import REPO, assert_ok, cli_env

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
