"""Two "nodes" of two ranks each, started by two torchrun agents that meet through c10d
rendezvous on loopback (as on two hosts, with the first host's address), train the curve of four
ranks on one node, into one run directory: rank 0's."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.helpers import TINY, assert_ok, cli_env, free_port, read_metrics, run_cli
from tests.support.parity import assert_parity

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=6", "train.eval_interval=3", "zero=stage1"]


def test_two_nodes_of_two_ranks_train_the_four_rank_curve(tmp_path):
    reference = tmp_path / "reference"
    assert_ok(run_cli([*ARGS, "parallel.dp=4", f"hydra.run.dir={reference}"]))
    shared = tmp_path / "shared"  # both "hosts" see it, as a cluster's shared file system
    shared.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**cli_env(), "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                                "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                                "--rdzv-id=megaframe-test", "-m", "megaframe.train", *ARGS],
                               cwd=shared, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node in range(2)]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-3000:]
    run_dirs = list(shared.glob("outputs/*/*"))
    assert len(run_dirs) == 1, f"expected one run directory, found {run_dirs}"
    assert "layout tp=1 pp=1 dp=4" in "".join(out for out, _ in outputs)
    assert_parity(read_metrics(run_dirs[0]), read_metrics(reference), "2 nodes x 2 ranks against 4 ranks")
