"""An elastic node (launch/node_agent.py) ends with one line and a documented exit code where torchrun
prints a traceback and exits 1. The ranks' own failures are test_elastic_recovery's (a real two-node
job); here the agent's own ways to end, in-process, and one real rendezvous that times out."""
from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousConnectionError,
                                                      RendezvousGracefulExitError)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

import megaframe.launch.local as local
from megaframe.launch.elastic import STORE_ENV, stop_file
from megaframe.launch.node_agent import main
from megaframe.parallel.elastic import STOP_FILE_ENV, forget_job_finished, job_stop, record_job_finished
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


def test_a_node_that_joins_after_the_job_finished_ends_with_0(tmp_path, monkeypatch, capsys):
    """A node that came late, or that SLURM restarted, after the job's run ended normally finds the
    rendezvous closed. It exited 1, which marks a finished job failed (and a requeue would train it
    again). Rank 0 records the normal end; a restart attempt never reads it, and a host it cannot reach
    is still exit 7 (a requeued job keeps its id, and the record may be the last run's)."""
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_file(tmp_path, RUN_ID)))
    record_job_finished()
    agent_raising(monkeypatch, RendezvousClosedError())
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 0
    err = capsys.readouterr().err
    assert err == ("megaframe-train: nothing to do: the job's run ended normally on its other nodes before this "
                   "node joined [exit 0]\n"), err
    assert job_stop() is None
    agent_raising(monkeypatch, RendezvousConnectionError("connection refused"))
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 7


def test_a_new_run_under_the_same_id_forgets_the_last_runs_normal_end(tmp_path, monkeypatch):
    """Rank 0 of a run starting (a requeued SLURM job keeps its rendezvous id) removes a finished record,
    so a node of the new run whose rendezvous closes is not told the job ended normally; a
    deterministic failure's record stays (it stops the new run's attempts, as documented)."""
    record = stop_file(tmp_path, RUN_ID)
    monkeypatch.setenv(STOP_FILE_ENV, str(record))
    record_job_finished()
    forget_job_finished()
    assert not record.exists()
    record.write_text(json.dumps({"exit_code": 3, "message": "diverged"}))
    forget_job_finished()
    assert record.exists()


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


def test_each_node_passes_self_launchs_signals_on_with_its_grace_unless_its_line_says(tmp_path, monkeypatch):
    """torchrun's defaults (no SIGUSR1, 30 s) let SLURM's --signal=USR1@90 kill the agent and leave its
    ranks running (they are in sessions of their own), or cut a save short."""
    seen = []
    monkeypatch.setattr(local, "run_agent", lambda args: seen.append(args) or 0)
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 0
    assert seen[-1].signals_to_handle == local.agent_signals() and "SIGUSR1" in seen[-1].signals_to_handle
    assert seen[-1].shutdown_timeout == local.SIGNAL_GRACE_S
    assert main([f"--run-dir={tmp_path}", "--shutdown-timeout=60", "--signals-to-handle=SIGTERM", *FLAGS]) == 0
    assert (seen[-1].signals_to_handle, seen[-1].shutdown_timeout) == ("SIGTERM", 60)
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT")
    assert main([f"--run-dir={tmp_path}", *FLAGS]) == 0
    assert (seen[-1].signals_to_handle, seen[-1].shutdown_timeout) == ("SIGTERM,SIGINT", local.SIGNAL_GRACE_S)


@pytest.mark.parametrize("flag, says", [("--nnodes=3:2", "min_nodes must be > 0 and <= max_nodes"),
                                        ("--rdzv-endpoint=head01:port", "must be an integer")])
def test_flags_torchrun_would_fail_on_are_refused_before_joining(flag, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(local, "run_agent", lambda args: pytest.fail("joined with flags it cannot use"))
    assert main([f"--run-dir={tmp_path}", *FLAGS[:4], flag, *FLAGS[4:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and err.endswith("[exit 2]\n"), err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("recorded", [None, 3, 0])  # 0: the run ended normally (record_job_finished)
def test_a_spare_node_whose_job_ended_says_so(recorded, tmp_path, monkeypatch, capsys):
    """A node that came when the job had launcher.nodes nodes waits as a spare; when the job ends, torch's
    agent swallows the RendezvousGracefulExitError and torch's launcher fails on the missing result
    (AttributeError). Torch's real agent and launcher here, only the wait replaced by its end."""
    if recorded:
        record = stop_file(tmp_path, RUN_ID)
        record.parent.mkdir()
        record.write_text(json.dumps({"exit_code": recorded, "message": "diverged: 5 steps in a row skipped"}))

    def ended(self, role):
        raise RendezvousGracefulExitError(f"The rendezvous '{RUN_ID}' is closed, terminating pending rendezvous.")

    monkeypatch.setattr(LocalElasticAgent, "_invoke_run", ended)
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "")  # torch's launcher sets it: restored after
    port = free_port()
    code = main([f"--run-dir={tmp_path}", "--nnodes=1", "--node-rank=0", "--nproc-per-node=1", "--rdzv-backend=static",
                 "--master-addr=127.0.0.1", f"--master-port={port}", f"--rdzv-id={RUN_ID}", "-m", "megaframe.train"])
    err = capsys.readouterr().err
    assert code == (recorded or 0) and err.count("\n") == 1, err
    assert "while this one waited as a spare: diverged" in err if recorded else "waited as a spare" in err, err
    assert not (tmp_path / "logs").exists()


def _rendezvous_state(store: dist.Store):
    state = C10dRendezvousBackend(store, RUN_ID).get_state()
    return None if state is None else pickle.loads(state[0])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_a_signal_while_a_node_waits_to_join_ends_it_with_its_code_and_leaves_the_rendezvous_open(signum, tmp_path):
    """Before its ranks start (a node may wait minutes to join), torch's agent has no signal handler:
    Ctrl-C was a traceback, and torch's launcher then closed the rendezvous for every node; SIGUSR1
    killed the agent outright. The rendezvous host here is the test's store, which outlives the node."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    node = subprocess.Popen([sys.executable, "-m", "megaframe.launch.node_agent", f"--run-dir={tmp_path}",
                             "--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=c10d",
                             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={RUN_ID}", "-m", "megaframe.train",
                             "model=gpt2_tiny"], cwd=REPO, env=cli_env(**{STORE_ENV: "1"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((state := _rendezvous_state(store)) and state.participants):  # the node waits for a second
        assert node.poll() is None and time.monotonic() < deadline, node.communicate()
        time.sleep(0.2)
    node.send_signal(signum)
    out, err = node.communicate(timeout=60)
    assert node.returncode == 128 + signum and "Traceback" not in out + err, (node.returncode, out + err)
    assert not _rendezvous_state(store).closed


def _torchrun_start_after(monkeypatch, tmp_path, rank: int, ends: BaseException | None, elastic: bool):
    """torchrun.start at `rank`, its run ending with `ends` (None: returned); the finished record's path."""
    from types import SimpleNamespace

    import megaframe.launch.hydra_run as hydra_run
    from megaframe.launch import torchrun

    def run(args):
        if ends is not None:
            raise ends
    monkeypatch.setattr(hydra_run, "run_hydra", run)
    record = stop_file(tmp_path, RUN_ID)
    monkeypatch.setenv(STOP_FILE_ENV, str(record))
    monkeypatch.setenv("RANK", str(rank))
    if elastic:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", RUN_ID)
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    job = SimpleNamespace(layout=SimpleNamespace(world_size=1), args=[], run_dir=str(tmp_path))
    if ends is None:
        assert torchrun.start(job) is None
    else:
        with pytest.raises(SystemExit):
            torchrun.start(job)
    return record


@pytest.mark.parametrize("rank, ends", [(0, None), (1, None), (0, SystemExit(130))], ids=["rank0", "rank1", "stopped"])
def test_rank_0_of_an_elastic_job_records_a_normal_end_only(rank, ends, tmp_path, monkeypatch):
    """What the late node above reads: written by rank 0 once its run returned, not by other ranks, not
    after a stop (a signal's exit)."""
    record = _torchrun_start_after(monkeypatch, tmp_path, rank, ends, elastic=True)
    assert record.exists() == (rank == 0 and ends is None)


def test_rank_0_outside_an_elastic_job_records_nothing(tmp_path, monkeypatch):
    """The same normal end of rank 0 as above, under torchrun without an elastic rendezvous."""
    assert not _torchrun_start_after(monkeypatch, tmp_path, 0, None, elastic=False).exists()
