"""Elastic training (launch/elastic.py) with real torchrun agents, one rank each, on this host as
three "nodes": kill one node (its agent and its worker) mid-run and the job goes on at dp=2; start a
node and it grows back to dp=3; every step is in metrics.jsonl once, with an uninterrupted one-rank
run's loss. The per-node command comes from megaframe-train itself (RUN_DIR/elastic_node.sh)."""
from __future__ import annotations

import math

import pytest

from tests.support.elastic_nodes import ELASTIC_ARGS, Nodes, kill_node, listening, read_records, steps_trained, wait_for
from tests.support.helpers import REPO, assert_ok, cli_env, free_port, read_metrics, run_cli

pytestmark = pytest.mark.slow
# long enough that the dp=2 stretch outlasts a joining node's start-up (each step is ~0.1 s here)
STEPS = 200
ARGS = [*ELASTIC_ARGS, f"train.max_steps={STEPS}"]


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_elastic_job_loses_a_node_goes_on_at_dp2_and_grows_back(tmp_path, engine):
    whole, run = tmp_path / "whole", tmp_path / "elastic"
    args = [*ARGS, f"backend={engine}"] + (["zero=stage3"] if engine == "fsdp2" else [])  # FSDP2 has no ZeRO-1
    # one rank, uninterrupted, and without the elastic run's save at every step (200 of them): a save
    # only reads the model, and one that changed what it trains fails the comparison below
    assert_ok(run_cli([*args, "train.save_interval=0", f"hydra.run.dir={whole}"]))

    port = free_port()
    printed = run_cli([*args, "launcher.min_nodes=1", "launcher.nodes=3", "cluster.gpus_per_node=1",
                       f"launcher.rdzv_endpoint=127.0.0.1:{port}", f"hydra.run.dir={run}"])
    assert_ok(printed)
    script = run / "elastic_node.sh"
    assert str(script) in printed.stdout and "--nnodes=1:3" in script.read_text()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script.read_text()

    with Nodes(script, tmp_path, REPO) as nodes:
        # every agent here matches the endpoint's host, and the first to bind its port hosts the c10d
        # store: the rest start once node 0 holds it, so the node killed below is not the host (whose
        # loss ends an elastic job: torchrun's limit, docs/elastic.md)
        first = nodes.start(cli_env())
        wait_for("node 0's rendezvous store", lambda: listening(port), [first], timeout=60)
        nodes.start(cli_env()), nodes.start(cli_env())
        wait_for("step 5 at dp=3", lambda: any(r["step"] >= 5 and r.get("dp") == 3
                                               for r in steps_trained(read_records(run))), nodes.procs)
        kill_node(nodes.procs[2])
        killed_at = max(r["step"] for r in steps_trained(read_records(run)))
        wait_for("training at dp=2", lambda: any(r.get("dp") == 2 for r in steps_trained(read_records(run))),
                 nodes.procs[:2])
        nodes.start(cli_env())
        wait_for("training at dp=3 again", lambda: any(r.get("dp") == 3 and r["step"] > killed_at
                                                       for r in steps_trained(read_records(run))), nodes.procs)
        for node in (nodes.procs[0], nodes.procs[1], nodes.procs[3]):
            assert node.wait(timeout=300) == 0
        story = nodes.story

    records = read_records(run)
    trained = steps_trained(records)
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1)), story()  # each step once
    sizes = [r["dp"] for r in trained]
    changes = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert changes == [3, 2, 3], (sizes, story())
    assert all(r["world_size"] == r["dp"] for r in trained)
    resized = [r for r in records if r.get("event") == "resized"]
    assert [(r["dp"]) for r in resized] == [2, 3], resized
    reference = {r["step"]: r["loss"] for r in steps_trained(read_metrics(whole))}
    worst = max(abs(r["loss"] - reference[r["step"]]) for r in trained)
    assert worst <= 1e-5 and all(math.isfinite(r["loss"]) for r in trained), worst
