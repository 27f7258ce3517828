"""megaframe-plan as a user runs it, and the pre-launch gate of megaframe-train (fail fast, parallel=auto)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO, TINY, assert_ok, cli_env, read_metrics, run_cli, run_module


def run_plan(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m megaframe.plan ARGS`, forked warm (helpers.run_module)."""
    return run_module("megaframe.plan", args, timeout=timeout)


def test_gpt_1t_fits_with_its_authors_layout_on_h100():
    table = run_plan(["recipe=gpt_1t", "cluster=h100_80g"])
    assert_ok(table)
    assert "tp=8 pp=64 dp=6" in table.stdout and "FITS" in table.stdout and "3072 devices" in table.stdout
    result = run_plan(["--json", "--dry-run=3071", "recipe=gpt_1t", "cluster=h100_80g", "launcher.nodes=384"])
    assert_ok(result)
    report = json.loads(result.stdout)
    plan, dry = report["plan"], report["dry_run"]
    assert (dry["stage"], dry["tp_rank"]) == (63, 7) and dry["layers"][-1] == "head (tied embed)"
    assert dry["parameters"] == dry["planner_parameters"] == plan["stages"][-1]["parameters"]
    assert plan["fits"] and plan["world_size"] == 3072 and 0 < plan["peak"] <= plan["capacity"] == 80 * 2**30
    assert plan["total_parameters"] == pytest.approx(1.0e12, rel=0.01)
    assert {"tp", "pp", "dp"} <= set(plan["comm_bytes"]) and plan["flops_per_step"] > 0 and plan["step_time_s"] > 0


def test_json_stdout_is_only_the_report_on_a_login_node_without_a_gpu():
    """A user on a CPU login node, DS_ACCELERATOR unset: DeepSpeed announces its CPU fallback on
    stdout, which must not end up in front of the JSON (`megaframe-plan --json | jq`)."""
    env = {k: v for k, v in cli_env().items() if k != "DS_ACCELERATOR"}
    result = subprocess.run([sys.executable, "-m", "megaframe.plan", "--json", "recipe=qwen3_235b_a22b"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert_ok(result)
    plan = json.loads(result.stdout)["plan"]
    assert plan["layout"]["grid"]["ep"] == 32 and plan["fits"]
    assert plan["active_parameters"] == pytest.approx(22e9, rel=0.01)


def test_mixtral_fits_an_h100_cluster_with_experts_split_over_ranks():
    table = run_plan(["recipe=mixtral_8x7b", "cluster=h100_80g"])
    assert_ok(table)
    assert "46.70B parameters" in table.stdout and "12.88B active per token" in table.stdout
    assert "ep=8" in table.stdout and "FITS" in table.stdout and "EP " in table.stdout
    result = run_plan(["--json", "--dry-run=127", "recipe=mixtral_8x7b", "cluster=h100_80g"])
    assert_ok(result)
    plan, dry = json.loads(result.stdout)["plan"], json.loads(result.stdout)["dry_run"]
    assert plan["total_parameters"] == pytest.approx(46.70e9, rel=0.01)
    assert plan["active_parameters"] == pytest.approx(12.88e9, rel=0.01)
    assert plan["layout"]["grid"]["ep"] == 8 and plan["fits"] and plan["comm_bytes"]["ep"] > 0
    # a rank holds 1 of the 8 experts of each block: the meta-device build agrees with the planner
    assert dry["parameters"] == dry["planner_parameters"] == plan["stages"][0]["parameters"]
    assert dry["parameters"] < plan["total_parameters"] / 6


def test_gpt_1t_without_model_parallelism_does_not_fit_and_layouts_that_do_are_proposed():
    result = run_plan(["--json", "recipe=gpt_1t", "cluster=h100_80g", "parallel.tp=1", "parallel.pp=1",
                       "parallel.dp=3072"])
    assert_ok(result)
    report = json.loads(result.stdout)
    assert not report["plan"]["fits"] and "does NOT fit" in report["verdict"]
    alternatives = report["alternatives"]
    assert alternatives and all(a["fits"] and a["world_size"] == 3072 for a in alternatives)
    times = [a["ranked_step_time_s"] for a in alternatives]
    assert times == sorted(times)


def test_bad_planner_input_is_one_line():
    result = run_plan(["cluster=h100_80g", "launcher.nodes=0"])
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "megaframe-plan: error: launcher.nodes=0 must be >= 1 (or null: as many as the layout needs)"]


def test_train_refuses_a_recipe_this_machine_cannot_hold_before_any_rank_starts():
    start = time.monotonic()
    result = run_cli(["recipe=gpt_1t"], timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("megaframe-train: error: the planner says this will not fit")
    assert "does NOT fit on local" in lines[0] and "GiB per device" in lines[0]
    assert "launching" not in result.stdout and "DeepSpeed info" not in result.stdout + result.stderr
    assert time.monotonic() - start < 240  # seconds; measured 21 s on the shared, loaded 2-core machine


@pytest.mark.slow
def test_parallel_auto_picks_a_fitting_layout_and_trains(tmp_path):
    result = run_cli([*TINY, "parallel=auto", "parallel.micro_batch_size=2", "parallel.global_batch_size=8",
                      "train.max_steps=2", "train.eval_interval=0", f"hydra.run.dir={tmp_path}"])
    assert_ok(result)
    assert "parallel=auto chose tp=1 pp=1 dp=1" in result.stdout
    assert "memory plan per rank" in result.stdout and "model states held" in result.stdout  # start-up summary
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    held = next(r for r in records if "model_states_bytes_per_rank" in r)
    assert len(held["model_states_bytes_per_rank"]) == 1 and held["model_states_bytes_per_rank"][0]["weights"] > 0


def test_help_is_the_usage_not_a_parse_error():
    result = run_plan(["--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("`megaframe-plan [--json] [--dry-run=RANK] [--config-dir DIR] [OVERRIDE ...]`") \
        and not result.stderr
