"""An elastic node (launch/node_agent.py) ends with one line and a documented exit code where torchrun
prints a traceback and exits 1. The ranks' own failures are test_elastic_recovery's (a real two-node
job); here the agent's own ways to end, in-process, and one real rendezvous that times out."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError

import megaframe.launch.local as local
from megaframe.launch.elastic import STORE_ENV, stop_file
from megaframe.launch.node_agent import main
from tests.support.helpers import REPO, cli_env, free_port

RUN_ID = "megaframe-abc"
FLAGS = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=head01:29400",
         f"--rdzv-id={RUN_ID}", "-m", "megaframe.train", "model=gpt2_tiny"]


def agent_raising(monkeypatch, error: Exception) -> None:
    def run_agent(args):
        assert args.rdzv_id == RUN_ID and args.training_script == "megaframe.train"  # torchrun's flags, parsed
        raise error

    monkeypatch.setattr(local, "run_agent", run_agent)


def test_a_rendezvous_closed_by_a_failed_job_ends_the_node_with_the_jobs_recorded_code(tmp_path, monkeypatch, capsys):
    record = stop_file(tmp_path, RUN_ID)
    record.parent.mkdir()
    record.write_text(json.dumps({"exit_code": 3, "message": "diverged: 5 steps in a row skipped"}))
    agent_raising(monkeypatch, RendezvousClosedError())
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 3
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1, said
    assert "the elastic job ended on another node: diverged: 5 steps in a row skipped [exit 3]" in said.err


def test_a_rendezvous_closed_with_no_record_says_so_and_exits_1(tmp_path, monkeypatch, capsys):
    agent_raising(monkeypatch, RendezvousClosedError())
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no deterministic failure recorded" in err and err.endswith("[exit 1]\n"), err


def test_a_host_it_cannot_reach_is_a_node_that_did_not_join(tmp_path, monkeypatch, capsys):
    agent_raising(monkeypatch, RendezvousConnectionError("The connection to the C10d store has failed."))
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rendezvous at head01:29400 (RendezvousConnectionError: The connection" in err, err
    assert "launcher.rdzv_endpoint" in err


def test_an_unexpected_agent_error_is_one_line_and_a_traceback_file(tmp_path, monkeypatch, capsys):
    agent_raising(monkeypatch, RuntimeError("store\nbroke"))
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 1
    err = capsys.readouterr().err
    logs = list((tmp_path / "logs").glob("node-agent-*.log"))
    assert len(logs) == 1 and "RuntimeError: store" in logs[0].read_text() and "Traceback" in logs[0].read_text()
    assert err == (f"megaframe-train: error: the elastic node agent failed: RuntimeError: store broke "
                   f"[exit 1; traceback in {logs[0]}]\n")


def test_without_its_run_dir_it_refuses(capsys):
    assert main(FLAGS) == 2
    assert "--run-dir=DIR" in capsys.readouterr().err


@pytest.mark.slow
def test_a_node_left_alone_times_out_with_one_line(tmp_path):
    """A real c10d rendezvous that two nodes must join and one does: torchrun's RendezvousTimeoutError,
    which torchrun reports with a traceback, is exit 7 and one line naming the fix."""
    port = free_port()
    node = subprocess.run([sys.executable, "-m", "megaframe.launch.node_agent", f"--run-dir={tmp_path}",
                           "--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={RUN_ID}",
                           "--rdzv-conf=join_timeout=2", "-m", "megaframe.train", "model=gpt2_tiny"],
                          cwd=REPO, env=cli_env(**{STORE_ENV: "1"}), capture_output=True, text=True, timeout=120)
    said = node.stdout + node.stderr
    assert node.returncode == 7 and "Traceback" not in said, said
    assert node.stderr.strip().splitlines()[-1] == (
        f"megaframe-train: error: fewer than 2 nodes joined the elastic job's rendezvous at 127.0.0.1:{port} "
        "within torchrun's join timeout (2 s); start the job's node line (RUN_DIR/elastic_node.sh, or the SLURM "
        "script's srun) on at least launcher.min_nodes=2 nodes [exit 7]"), said
