"""Marking the eager functions costs no start-up; compiling disables them (compile_breaks.py).
torch.compiler.disable as a decorator imported torch._dynamo into every process: 2.3 s of each
rank's start-up on CI's machine, although only train.compile=true compiles."""
from __future__ import annotations

import subprocess
import sys

from tests.support.helpers import REPO


def test_importing_the_trainer_does_not_load_dynamo():
    probe = "import sys, megaframe.training.trainer; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_compiling_blocks_turns_every_marked_function_into_a_graph_break():
    probe = """
import torch
from megaframe.common.compile_breaks import _MARKED
from megaframe.model.factory import build_model, compile_blocks, resolve_dims
from megaframe.config.schema import ModelConfig
from megaframe.parallel.state import ParallelState
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel import mappings, grad_bucket
from megaframe.model import moe
marked = [mappings._run_collective, mappings._all_to_all_rows_eagerly, mappings.all_reduce_max, grad_bucket.ReplicatedGradBucket.collect, moe.MoE._routed]
assert len(_MARKED) == 5 and not any(getattr(f, "_torchdynamo_disable", False) for f in marked)
cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8)
compile_blocks(build_model(resolve_dims(cfg, 257), ParallelState(ParallelDims(), rank=0), seed=0))
marked = [mappings._run_collective, mappings._all_to_all_rows_eagerly, mappings.all_reduce_max, grad_bucket.ReplicatedGradBucket.collect, moe.MoE._routed]
print(all(getattr(f, "_torchdynamo_disable", False) for f in marked))
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "True"
