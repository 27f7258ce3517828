"""The warm interpreter run_cli forks its commands from (tests/support/cli_zygote.py) behaves as a fresh
`python -m megaframe.train`: the same exit code, output and curve, argv/cwd/environment applied,
and a command past its timeout killed as subprocess.run would kill it."""
from __future__ import annotations

import subprocess

import pytest

from tests.support import helpers
from tests.support.helpers import TINY, cli_env, curve, read_metrics, run_cli

pytestmark = pytest.mark.slow


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_a_warm_run_is_the_fresh_run(tmp_path):
    assert helpers._zygote_for(cli_env()) is not None, "the plain environment must be served warm"
    args = [*TINY, "train.max_steps=3", "hydra.run.dir=run"]  # relative: the child's cwd must apply
    (tmp_path / "warm").mkdir()
    (tmp_path / "fresh").mkdir()
    warm = run_cli(args, cwd=tmp_path / "warm")
    fresh = run_cli(args, cwd=tmp_path / "fresh", fresh=True)
    assert warm.returncode == fresh.returncode == 0, warm.stderr + fresh.stderr
    assert curve(read_metrics(tmp_path / "warm" / "run"), "loss") == curve(read_metrics(tmp_path / "fresh" / "run"), "loss")
    assert _last_line(warm.stdout).split("|")[0] == _last_line(fresh.stdout).split("|")[0]
    assert warm.stderr == fresh.stderr


def test_a_refusal_and_an_injected_fault_end_the_same_warm_or_fresh(tmp_path):
    refusals = [run_cli([*TINY, "optim.lrr=1"], fresh=fresh) for fresh in (False, True)]
    assert refusals[0].returncode == refusals[1].returncode == 2
    assert refusals[0].stderr == refusals[1].stderr and refusals[0].stderr.count("\n") == 1
    # an environment key read at run time reaches the warm child (a full disk at step 2's save)
    faulted = [run_cli([*TINY, "train.max_steps=4", "train.save_interval=2", f"hydra.run.dir={tmp_path / name}"],
                       fresh=name == "fresh", env=cli_env(MEGAFRAME_FAULTS="disk_full@2"))
               for name in ("warm", "fresh")]
    assert faulted[0].returncode == faulted[1].returncode == 8, faulted[0].stderr
    assert _last_line(faulted[0].stderr) == _last_line(faulted[1].stderr).replace("/fresh", "/warm")


def test_a_warm_command_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli([*TINY, "train.max_steps=200", f"hydra.run.dir={tmp_path}"], timeout=2)
    # the zygote reaped it and serves the next command
    assert run_cli([*TINY, "optim.lrr=1"]).returncode == 2


def test_a_device_run_is_served_warm_and_is_the_fresh_run(tmp_path):
    """The CUDA-shaped device's runs fork from a zygote of their own, started on the device: the same
    curve, output and per-process report (host reads with their call sites, emulated kernels, no
    violations) as a fresh interpreter on the device, whose start-up removed DS_ACCELERATOR (a child
    given it back would train on the host)."""
    from tests.support.fakecuda.env import fake_cuda_env
    from tests.support.fakecuda.ledger import read_reports

    args = [*TINY, "train.max_steps=3", "train.eval_interval=3"]
    warm_env = fake_cuda_env(tmp_path / "warm-reports")
    assert helpers._zygote_for(warm_env) not in (None, helpers._zygote_for(cli_env())), "served by its own kind"
    seen = {}
    for name, env in (("warm", warm_env), ("fresh", fake_cuda_env(tmp_path / "fresh-reports"))):
        result = run_cli([*args, f"hydra.run.dir={tmp_path / name}"], env=env, fresh=name == "fresh")
        assert result.returncode == 0, result.stderr[-2000:]
        assert "| device cuda:0 (NVIDIA H100" in result.stdout, result.stdout[-2000:]
        reports = [{key: r[key] for key in ("rank", "argv", "violations", "kernels")} | {"syncs": sorted(map(tuple, r["syncs"]))}
                   for r in read_reports(tmp_path / f"{name}-reports")]
        seen[name] = (curve(read_metrics(tmp_path / name), "loss"), _last_line(result.stdout).split("|")[0], reports)
    assert seen["warm"] == seen["fresh"]
    assert seen["warm"][2] and seen["warm"][2][0]["argv"][0].endswith("megaframe/train.py")
