"""The planner's step time divides the step's FLOPs by the cluster's peak in the plan's precision."""
from __future__ import annotations

import pytest
import torch

from megaframe.config.compose import compose
from megaframe.plan.cli import plan, planned_world_size


def _step_time(*overrides: str) -> float:
    cfg, _ = compose(["recipe=llama2_7b", "cluster=h100_80g", *overrides])
    _, est, _ = plan(cfg, planned_world_size(cfg))
    return est.step_time_s


def test_a_profiles_step_time_uses_its_gpus_peak_in_the_plans_precision(tf32_restored):
    """cluster=h100_80g names its GPU: the same FLOPs take 989/66.9 times longer in fp32 (TF32 off,
    torch's default) than in bf16. The profile once gave one peak, bf16's, to every precision."""
    torch.backends.cuda.matmul.allow_tf32 = False
    bf16, fp32 = _step_time("precision=bf16"), _step_time("precision=fp32")
    assert fp32 / bf16 == pytest.approx(989.0 / 66.9)
    # precision.tf32=true: the fp32 matmuls on TF32 tensor cores, half the bf16 rate
    assert _step_time("precision=fp32", "precision.tf32=true") / bf16 == pytest.approx(989.0 / 494.7)
    # a peak given by hand is used as given, in every precision
    assert _step_time("precision=bf16", "cluster.peak_tflops=500") == _step_time("precision=fp32", "cluster.peak_tflops=500")


def _estimate(*overrides: str):
    cfg, _ = compose(["recipe=llama3_8b", "cluster=h100_80g", "backend=fsdp2", "zero=stage3", *overrides])
    return plan(cfg, planned_world_size(cfg))[1]


def test_hsdp_ranks_faster_than_sharding_over_every_node():
    """llama3_8b on 64 GPUs (eight nodes of eight): FSDP2 sharded over all 64 moves its data-parallel
    traffic over the inter-node links; with eight replicas of a node's eight ranks most of it stays in
    the node and only each rank's gradient shard crosses. The plan once counted one ring over the 64
    for both, at the inter-node links, and ranked them alike."""
    batch = ["parallel.dp=64", "parallel.global_batch_size=512"]
    fsdp, hsdp = _estimate(*batch), _estimate(*batch, "parallel.dp_replicate=8")
    assert "dp_replicas" not in fsdp.comm_bytes and 0 < hsdp.comm_bytes["dp_replicas"] < hsdp.comm_bytes["dp"] / 10
    assert hsdp.ranked_step_time_s < fsdp.ranked_step_time_s
    # the same replicas on nodes of four: a shard group of eight spans two nodes, and loses its advantage
    quads = _estimate(*batch, "parallel.dp_replicate=8", "cluster.gpus_per_node=4")
    assert quads.ranked_step_time_s > hsdp.ranked_step_time_s


def test_a_pipeline_stage_talks_to_the_next_across_nodes():
    """pp is the outermost axis (parallel/dims.py): at tp=1 pp=2 dp=4 on nodes of four, stage 0 is one
    node and stage 1 the other. The plan once timed the pipeline's sends at the node's links whenever
    tp x pp fit in one node, and the data axis (a stage's four ranks, one node) at the inter-node links.
    Short sequences, so that the data axis' traffic is not all hidden behind compute."""
    layout = ["parallel.tp=1", "parallel.pp=2", "parallel.dp=4", "parallel.global_batch_size=64", "zero=stage2",
              "model.seq_length=256"]
    one_node, two_nodes = _estimate(*layout), _estimate(*layout, "cluster.gpus_per_node=4")
    assert one_node.comm_bytes == two_nodes.comm_bytes
    cluster = compose(["cluster=h100_80g"])[0].cluster
    moved_across = one_node.comm_bytes["pp"] * (1 / cluster.inter_node_gbps - 1 / cluster.intra_node_gbps) / 1e9
    assert two_nodes.ranked_step_time_s - one_node.ranked_step_time_s == pytest.approx(moved_across, rel=1e-6)
