"""launcher=ray on a local Ray cluster of 2 CPU workers: the dp=2 self-launch curve, and a worker
killed mid-run is restarted by Ray (FailureConfig), the run resumes from its checkpoint and ends
with the uninterrupted run's metrics; without Ray installed, one line before anything starts."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.helpers import TINY, assert_ok, cli_env, free_port, read_metrics, run_cli
from tests.support.parity import assert_parity
from tests.support.ray_processes import LEAN_RAY, actors_started, kill_processes, processes_of

pytestmark = pytest.mark.slow
ARGS = [*TINY, "train.max_steps=6", "train.eval_interval=3", "train.save_interval=2", "zero=stage1", "parallel.dp=2"]


def _ray_env(**extra: str) -> dict[str, str]:
    """The environment of a Ray cluster or job here. Ray starts its workers (which run the ranks) at
    niceness 15: beside CI's other test processes at niceness 0 they got a few percent of the two
    cores, and a 70 s job ran past its 600 s timeout. The cluster's raylet reads this variable when
    it starts (ray start, or the local cluster ray.init makes). Ray's side services no test reads are
    off (ray_processes.LEAN_RAY)."""
    return {**cli_env(), "OMP_NUM_THREADS": "1", "RAY_worker_niceness": "0", **LEAN_RAY, **extra}


@pytest.fixture(scope="module")
def ray_cluster():
    """One Ray cluster started beforehand (`ray start --head`, as on a real cluster) that the tests
    join with launcher.ray_address: starting a local cluster per job cost 20-40 s of CI's two cores
    each time. The first test still starts its own, through megaframe's ray.init. Ray 2.5x's
    clusters use token authentication, which a driver joins with RAY_AUTH_MODE=token. RAY_ADDRESS
    names this cluster to the processes that look one up on their own (Ray Train's placement-group
    cleaner): with another Ray cluster on the host (CI's other Ray test file) they fail with "Found
    multiple active Ray instances" and print a traceback into the job's output. Yields (address,
    environment, the cluster's temp dir)."""
    pytest.importorskip("ray", reason="Ray is the optional extra megaframe[ray]; .ci/run installs it with [test]")
    port = free_port()
    env = _ray_env(RAY_AUTH_MODE="token", RAY_ADDRESS=f"127.0.0.1:{port}")
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    # its own temp dir (short: Ray's socket paths under it stay within 107 bytes), by which its
    # processes are found and killed afterwards: `ray stop` would also stop other files' clusters
    root = Path(tempfile.mkdtemp(prefix="mfray-"))
    started = subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                              "--disable-usage-stats", f"--temp-dir={root}"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}", env, root
    finally:
        kill_processes(processes_of(root))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def dp2_reference(tmp_path_factory):
    """ARGS self-launched at dp=2: the curve every Ray job of ARGS must train."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert_ok(run_cli([*ARGS, f"hydra.run.dir={run_dir}"]))
    return read_metrics(run_dir)


def test_ray_workers_train_the_dp2_curve_and_survive_a_killed_worker(tmp_path, dp2_reference):
    """Started as a user's first launcher=ray run: megaframe's ray.init makes a local cluster."""
    pytest.importorskip("ray", reason="Ray is the optional extra megaframe[ray]; .ci/run installs it with [test]")
    ray_run = tmp_path / "ray"
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    env = _ray_env(MEGAFRAME_FAULTS="kill@4:1", MEGAFRAME_FAULTS_STAMPS=str(stamps))
    result = run_cli([*ARGS, "launcher=ray", "launcher.max_failures=1", "logging.wandb.mode=offline",
                      f"hydra.run.dir={ray_run}"], env=env)
    assert_ok(result)
    assert (stamps / "kill-rank1-step4").exists(), "the fault did not fire: nothing was restarted"
    out = result.stdout + result.stderr
    assert "resumed from" in out and "at step 2" in out
    assert_parity(read_metrics(ray_run), dp2_reference, "launcher=ray with a restart against dp=2")
    # one W&B run: both attempts logged (rank 0 of each) under the run directory's id
    run_id = (ray_run / "wandb_run_id").read_text().strip()
    attempts = sorted(path.name for path in (ray_run / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(name.endswith(f"-{run_id}") for name in attempts), (run_id, attempts)


def test_without_ray_launcher_ray_is_one_line_before_anything_starts(tmp_path):
    blocker = tmp_path / "no_ray"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(  # hides an installed ray from the check
        "import importlib.util, sys\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a, **k: None if name == 'ray' else _find(name, *a, **k)\n")
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join([str(blocker), cli_env().get("PYTHONPATH", "")])}
    result = run_cli([*ARGS, "launcher=ray", f"hydra.run.dir={tmp_path / 'run'}"], env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "megaframe[ray]"' in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_ray_sweep_runs_each_point_on_ray_with_its_own_curve(tmp_path, ray_cluster, dp2_reference):
    """-m with launcher=ray on a cluster started beforehand and joined by launcher.ray_address, as on
    a real Ray cluster: each point is a whole megaframe-train that starts its own Ray workers, in its
    own run directory, and trains what the same point self-launched trains (point 1 is ARGS itself,
    optim.lr's default). No job started Ray Data's DatasetManager actor (megaframe passes no datasets:
    launch/ray.py leaves it out, one Python process less per worker-group start)."""
    address, env, root = ray_cluster
    sweep = tmp_path / "sweep"
    result = run_cli(["-m", *ARGS, "optim.lr=1e-3,3e-3", "launcher=ray", f"launcher.ray_address={address}",
                      f"hydra.sweep.dir={sweep}"], env=env)
    assert_ok(result)
    assert all((sweep / point / "ray").is_dir() for point in ("0", "1")), "a point did not run on Ray"
    assert "launching 2 ranks" not in result.stdout  # no point fell back to the self-launcher
    assert_parity(read_metrics(sweep / "1"), dp2_reference, "Ray sweep point 1 against ARGS self-launched")
    assert read_metrics(sweep / "0")[-1]["eval_loss"] != read_metrics(sweep / "1")[-1]["eval_loss"]
    actors = actors_started(root)
    assert actors["RayTrainWorker"] >= 4 and "DatasetManager" not in actors, actors


def test_a_hung_ray_worker_ends_the_job_after_megaframes_collective_timeout(tmp_path, ray_cluster):
    """Ray makes the process group: it gets train.collective_timeout_s (not Ray's 30 minutes), so the
    rank left waiting raises, and the job ends with the hung rank's exit code 7."""
    address, cluster_env, _ = ray_cluster
    timeout_s = 20
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    env = {**cluster_env, "MEGAFRAME_FAULTS": "hang@3:1", "MEGAFRAME_FAULTS_STAMPS": str(stamps)}
    result = run_cli([*ARGS, "launcher=ray", f"launcher.ray_address={address}", "launcher.max_failures=0",
                      f"train.collective_timeout_s={timeout_s}", f"hydra.run.dir={tmp_path / 'run'}"], env=env, timeout=400)
    ended = time.time()
    assert result.returncode == 7, (result.stdout + result.stderr)[-3000:]
    out = result.stdout + result.stderr
    assert "rank 1 did not reach a collective" in out and "Traceback" not in out, out[-3000:]
    hung_for = ended - (stamps / "hang-rank1").stat().st_mtime
    assert timeout_s - 1 <= hung_for < timeout_s + 60, hung_for


def test_a_worker_killed_without_restarts_left_is_one_line_and_exit_1(tmp_path, ray_cluster):
    """A rank killed by a signal (the OOM killer, a node lost) says nothing itself: the driver says
    what Ray reported, in one line, with the generic exit code 1, and no traceback."""
    address, cluster_env, _ = ray_cluster
    env = {**cluster_env, "MEGAFRAME_FAULTS": "kill@3:1"}
    result = run_cli([*ARGS, "launcher=ray", f"launcher.ray_address={address}", "launcher.max_failures=0",
                      f"hydra.run.dir={tmp_path / 'run'}"], env=env, timeout=400)
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    out = result.stdout + result.stderr
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert "Traceback" not in out and any("megaframe-train: error: Ray Train failed:" in e for e in errors), out[-3000:]


def test_ray_restarts_do_not_replay_a_divergence(tmp_path, ray_cluster):
    """FailureConfig restarts the worker group after any failure; a deterministic one (here a
    divergence, exit 3) is recorded in the run dir, so each restart stops at once (noting it in the
    rank's log) instead of training into it again, and the job ends with the cause's one line and
    exit 3."""
    address, env, _ = ray_cluster
    run = tmp_path / "run"
    result = run_cli([*ARGS, "train.max_steps=30", "optim.lr=1e6", "launcher=ray", f"launcher.ray_address={address}",
                      "launcher.max_failures=1", f"hydra.run.dir={run}"], env=env, timeout=500)
    assert result.returncode == 3, (result.stdout + result.stderr)[-3000:]
    out = result.stdout + result.stderr
    ours = [line for line in out.splitlines() if line.startswith("megaframe-train: error")]
    assert len(ours) == 1 and "diverged" in ours[0] and "Traceback" not in out, out[-3000:]
    for rank in (0, 1):  # the restart reached every rank, which stopped before training
        stops = [line for line in (run / "logs" / f"rank{rank}.log").read_text().splitlines()
                 if line.startswith("megaframe-train: error: not retrying: an earlier attempt of this job failed "
                                    "with: diverged")]
        assert len(stops) == 1, (rank, stops)
    # a new launch in the same directory is a new job: it trains (here into the same divergence)
    again = run_cli([*ARGS, "train.max_steps=30", "optim.lr=1e6", "launcher=ray", f"launcher.ray_address={address}",
                     "launcher.max_failures=0", f"hydra.run.dir={run}"], env=env, timeout=500)
    out = again.stdout + again.stderr
    assert "resumed from" in out and "not retrying" not in out, out[-3000:]


def test_a_cluster_address_where_nothing_answers_is_one_line_at_once(tmp_path):
    """Ray itself would wait minutes on a closed port before failing: megaframe checks first."""
    pytest.importorskip("ray", reason="Ray is the optional extra megaframe[ray]; .ci/run installs it with [test]")
    port = free_port()
    started = time.time()
    result = run_cli([*ARGS, "launcher=ray", f"launcher.ray_address=127.0.0.1:{port}", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 2 and time.time() - started < 60, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"launcher.ray_address=127.0.0.1:{port}: nothing answers there" in lines[0], lines


def test_joining_a_listener_that_is_not_ray_gives_up_after_connect_timeout_s(tmp_path):
    """Something answers at the address but it is not a Ray cluster: ray.init would wait on it;
    launcher.connect_timeout_s ends the job with one line, and Ray's messages go to the run's logs."""
    pytest.importorskip("ray", reason="Ray is the optional extra megaframe[ray]; .ci/run installs it with [test]")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        port = listener.getsockname()[1]
        started = time.time()
        result = run_cli([*ARGS, "launcher=ray", f"launcher.ray_address=127.0.0.1:{port}",
                          "launcher.connect_timeout_s=5", f"hydra.run.dir={tmp_path}"], timeout=300)
        waited = time.time() - started
    assert result.returncode == 2, (result.stdout + result.stderr)[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Ray cluster joined within launcher.connect_timeout_s=5 s" in lines[0], lines
    assert 5 <= waited < 120, waited
    assert (tmp_path / "logs" / "ray_init.log").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_signal_to_the_ray_driver_stops_every_worker_at_one_step_and_saves_it(tmp_path, ray_cluster, signum):
    """Ctrl-C (or `ray job stop`'s SIGTERM) at the driver: its number goes to the run dir, rank 0
    takes it as its own signal, every rank stops after the same step and saves it, and the driver
    exits 128 + the signal's number, as a self-launched run does. Before, Ray Train's own SIGINT
    handler aborted the run (the workers killed unsaved) and the driver exited 1 saying nothing; a
    SIGTERM killed the driver and its job. The resume line continues from the saved step."""
    address, env, _ = ray_cluster
    run = tmp_path / "run"
    args = [*ARGS, "train.max_steps=2000", "train.eval_interval=0", "train.save_interval=0", "launcher=ray",
            f"launcher.ray_address={address}", "launcher.max_failures=1", f"hydra.run.dir={run}"]
    driver = subprocess.Popen([sys.executable, "-m", "megaframe.train", *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 3):
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
        time.sleep(0.2)
    driver.send_signal(signum)
    out, err = driver.communicate(timeout=300)
    name = signal.Signals(signum).name
    assert driver.returncode == 128 + signum, (out + err)[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
    assert f"megaframe-train: {name}: the Ray workers stop after their step, saving first" in err, err[-3000:]
    closing = [line for line in out.splitlines() if line.startswith(f"megaframe: stopped by {name} at step ")]
    assert len(closing) == 1, out[-3000:]
    stopped_at = int(closing[0].split("at step ")[1].split("/")[0])
    assert stopped_at < 2000
    saved = sorted(p.name for p in (run / "checkpoints").glob("global_step*"))
    assert saved == [f"global_step{stopped_at}"], saved
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, stopped_at + 1))
    assert not (run / ".stop_request").exists()
