"""Fault tolerance under torchrun --max-restarts with train.resume=auto: SIGKILL of a random rank at
a random step, several times (once aimed at a checkpoint being written), still ends with the
metrics of an uninterrupted run; a half-written save leaves the previous checkpoint in charge; a
checkpoint with a flipped byte is refused with a one-line error."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.support.helpers import REPO, TINY, assert_ok, cli_env, read_metrics, run_cli
from tests.support.warm_ranks import ZYGOTE_NAME
from megaframe.common.failures import ExitCode

pytestmark = pytest.mark.slow
CURVES = ("loss", "grad_norm", "lr", "eval_loss", "consumed_samples")
ARGS = [*TINY, "parallel.dp=2", "zero=stage1", "train.max_steps=14", "train.save_interval=2"]


def _values(records: list[dict]) -> list[tuple]:
    return [(r["step"], *(r.get(k) for k in CURVES)) for r in records]


def _last_step(run_dir: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(run_dir)), default=-1)
    except (OSError, ValueError):  # read while rank 0 appends
        return -1


class RankKiller(threading.Thread):
    """SIGKILLs a random worker of a torchrun agent: first while a checkpoint is being written (a
    tmp-global_step* directory exists), then at random steps, each after the job made progress."""

    def __init__(self, agent_pid: int, run_dir: Path, kills: int, seed: int):
        super().__init__(daemon=True)
        self.agent, self.run_dir, self.kills, self.rng = psutil.Process(agent_pid), run_dir, kills, random.Random(seed)
        self.log: list[str] = []
        self.stop = threading.Event()

    def _workers(self) -> list[psutil.Process]:
        workers = []
        for child in self.agent.children():
            try:
                # a rank: torchrun's agent execs it, or (tests/support/warm_ranks.py) forks it from its
                # rank zygote, which shares the agent's command line but not its name
                if (child.status() != psutil.STATUS_ZOMBIE and "megaframe.train" in " ".join(child.cmdline())
                        and child.name() != ZYGOTE_NAME):
                    workers.append(child)
            except psutil.Error:  # exited (or became a zombie) while we looked
                continue
        return workers

    def _kill_one(self, why: str) -> None:
        workers = self._workers()
        if not workers:
            return
        victim = self.rng.choice(workers)
        try:
            rank = victim.environ().get("RANK", "?")
        except psutil.Error:
            rank = "?"
        os.kill(victim.pid, signal.SIGKILL)
        self.log.append(f"killed rank {rank} {why}")
        # wait for the agent to tear the group down and start a new one
        while not self.stop.is_set() and any(w.pid == victim.pid for w in self._workers()):
            time.sleep(0.05)

    def run(self) -> None:
        checkpoints = self.run_dir / "checkpoints"
        try:
            # 1: during a save (tmp-global_stepN exists), within the first saves of the run
            deadline = time.monotonic() + 300
            while not self.stop.is_set() and time.monotonic() < deadline and _last_step(self.run_dir) < 9:
                if checkpoints.is_dir() and any(p.name.startswith("tmp-global_step") for p in checkpoints.iterdir()):
                    self._kill_one(f"mid-save ({sorted(p.name for p in checkpoints.iterdir())})")
                    break
                time.sleep(0.005)
            # 2..: at a random step, a few steps after the restarted job got going again
            while not self.stop.is_set() and len(self.log) < self.kills:
                start = _last_step(self.run_dir)
                target = start + self.rng.randint(2, 3)
                if target >= 13:
                    break
                while not self.stop.is_set() and _last_step(self.run_dir) < target:
                    time.sleep(0.02)
                if not self.stop.is_set():
                    self._kill_one(f"at step {_last_step(self.run_dir)}")
        except psutil.NoSuchProcess:  # the agent itself is gone: the job ended
            pass


def test_sigkill_of_random_ranks_recovers_to_the_uninterrupted_result(tmp_path):
    seed = int(time.time())
    whole, faulty = tmp_path / "whole", tmp_path / "faulty"
    assert_ok(run_cli([*ARGS, f"hydra.run.dir={whole}"]))

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=6",
           "--monitor-interval=0.2", "-m", "megaframe.train", *ARGS, "logging.wandb.mode=offline",
           "train.resume=auto", "train.keep_checkpoints=2", f"hydra.run.dir={faulty}"]
    agent = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = RankKiller(agent.pid, faulty, kills=3, seed=seed)
    killer.start()
    try:
        output, _ = agent.communicate(timeout=900)
    finally:
        killer.stop.set()
        if agent.poll() is None:
            agent.kill()
    (tmp_path / "torchrun.log").write_text(output or "")
    story = f"seed {seed} (log {tmp_path / 'torchrun.log'}): " + "; ".join(killer.log)
    assert agent.returncode == 0, f"{story}\n{output[-6000:]}"
    assert len(killer.log) >= 2, story
    assert output.count("resumed from") >= len(killer.log) - 1, f"{story}\n{output[-6000:]}"

    assert _values(read_metrics(faulty)) == _values(read_metrics(whole)), story  # fp32 on CPU: exact
    # the W&B run kept its id over every restart
    run_id = (faulty / "wandb_run_id").read_text().strip()
    offline_runs = list((faulty / "wandb").glob("offline-run-*"))
    assert len(offline_runs) >= 2 and all(p.name.endswith(run_id) for p in offline_runs), story
    # keep_checkpoints=2: the two newest survive, no debris
    kept = sorted(p.name for p in (faulty / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["global_step12", "global_step14"], story


def test_half_written_save_leaves_previous_checkpoint_loadable(tmp_path):
    run, whole = tmp_path / "run", tmp_path / "whole"
    args = [*TINY, "train.max_steps=6", "train.save_interval=2", f"hydra.run.dir={run}"]
    assert_ok(run_cli([*args, "train.exit_at_step=4"]))
    assert_ok(run_cli([*TINY, "train.max_steps=6", f"hydra.run.dir={whole}"]))
    checkpoints = run / "checkpoints"
    # a save of step 6 killed half-way: its tmp dir holds part of the files, one of them truncated
    partial = checkpoints / "tmp-global_step6"
    (partial / "shards").mkdir(parents=True)
    for name in ("index.json", "shards/rank00000.safetensors"):
        data = (checkpoints / "global_step4" / name).read_bytes()
        (partial / name).write_bytes(data[: len(data) // 3])
    result = run_cli(args)
    assert_ok(result)
    assert "resumed from" in result.stdout and "global_step4 at step 4" in result.stdout
    assert _values(read_metrics(run)) == _values(read_metrics(whole))
    assert not list(checkpoints.glob("tmp-*"))


def test_flipped_byte_is_refused_with_one_line(tmp_path):
    args = [*TINY, "train.max_steps=3", f"hydra.run.dir={tmp_path}"]
    assert_ok(run_cli([*args, "train.exit_at_step=2"]))
    target = tmp_path / "checkpoints" / "global_step2" / "shards/rank00000.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) - 100] ^= 0x10
    target.write_bytes(bytes(data))
    result = run_cli(args)
    assert result.returncode == ExitCode.BAD_CHECKPOINT == 5, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("megaframe-train: error:")]
    assert len(errors) == 1 and "global_step2 is corrupted: shards/rank00000.safetensors does not match its sha256" in errors[0], \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert "Traceback" in (tmp_path / "logs" / "rank0.log").read_text()  # the details stay in the run dir
