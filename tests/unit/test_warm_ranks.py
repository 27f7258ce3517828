"""megaframe-train's self-launched ranks forked warm (tests/support/warm_ranks.py) are the ranks torch's agent
would exec: the same curve, output, and exit code when a rank dies, from a launcher forked by the
CLI zygote and from one started as a fresh interpreter (the sitecustomize path). The spawn log
proves the ranks were forked, so a change that silently falls back to fresh ranks fails here."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.helpers import FRESH_RANKS, REPO, TINY, cli_env, curve, read_metrics, run_cli

pytestmark = pytest.mark.slow
DP2 = [*TINY, "parallel.dp=2", "zero=stage1", "train.max_steps=4"]


def _forked(log) -> list[str]:
    """The ranks (RANK values) the launcher forked warm."""
    return sorted(json.loads(line)["rank"] for line in log.read_text().splitlines()) if log.exists() else []


def _steps(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("launcher", ["cli zygote", "fresh interpreter"])
def test_warm_ranks_train_the_fresh_ranks_curve(launcher, tmp_path):
    runs = {}
    for name in ("warm", "fresh"):
        log = tmp_path / f"{name}.log"
        env = cli_env(MEGAFRAME_TESTS_WARM_RANKS_LOG=str(log), **(FRESH_RANKS if name == "fresh" else {}))
        args = [*DP2, f"hydra.run.dir={tmp_path / name}"]
        if launcher == "cli zygote":
            result = run_cli(args, env=env)
        else:
            result = subprocess.run([sys.executable, "-m", "megaframe.train", *args], cwd=REPO, env=env,
                                    capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (result, _forked(log))
    (warm, warm_forked), (fresh, fresh_forked) = runs["warm"], runs["fresh"]
    assert warm_forked == ["0", "1"] and fresh_forked == []
    assert curve(read_metrics(tmp_path / "warm"), "loss") == curve(read_metrics(tmp_path / "fresh"), "loss")
    assert _steps(warm.stdout) and [s.split(" tok/s")[0] for s in _steps(warm.stdout)] == \
        [s.split(" tok/s")[0] for s in _steps(fresh.stdout)]
    assert warm.stderr == fresh.stderr


def test_a_killed_warm_rank_ends_the_job_as_a_killed_fresh_one(tmp_path):
    results = {}
    for name in ("warm", "fresh"):
        log = tmp_path / f"{name}.log"
        env = cli_env(MEGAFRAME_FAULTS="kill@3:1", MEGAFRAME_TESTS_WARM_RANKS_LOG=str(log),
                      **(FRESH_RANKS if name == "fresh" else {}))
        results[name] = run_cli([*DP2, "train.max_steps=6", f"hydra.run.dir={tmp_path / name}"], env=env)
        assert bool(_forked(log)) == (name == "warm")
    warm, fresh = results["warm"], results["fresh"]
    assert warm.returncode == fresh.returncode == 1, warm.stderr[-3000:]
    errors = {name: [line for line in r.stderr.splitlines() if line.startswith("megaframe-train: error")]
              for name, r in results.items()}
    assert errors["warm"] == errors["fresh"] and "SIGKILL" in errors["warm"][0], errors


def test_torchruns_own_agent_forks_its_ranks_warm(tmp_path):
    """`python -m torch.distributed.run ... -m megaframe.train` (the elastic tests' nodes, --max-restarts
    jobs) runs torchrun's __main__, not the module install_in_launcher wraps: the agent's ranks are
    forked warm all the same, and train the curve the self-launched ranks train."""
    log = tmp_path / "spawned.log"
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               "-m", "megaframe.train", *DP2, f"hydra.run.dir={tmp_path / 'torchrun'}"],
                              cwd=REPO, env=cli_env(MEGAFRAME_TESTS_WARM_RANKS_LOG=str(log)), capture_output=True,
                              text=True, timeout=600)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert _forked(log) == ["0", "1"]
    self_launched = run_cli([*DP2, f"hydra.run.dir={tmp_path / 'self'}"])
    assert self_launched.returncode == 0, self_launched.stderr[-3000:]
    assert curve(read_metrics(tmp_path / "torchrun"), "loss") == curve(read_metrics(tmp_path / "self"), "loss")
