"""backend=fsdp2 with pipeline stages (torch.distributed.pipelining) on real gloo ranks against
DeepSpeed's single-rank run of the same seed: fp32, 8 steps, every logged loss, gradient norm and
eval loss within rtol 1e-5 (8x the reference's own rounding at a step where it is larger), the
gradient norm within the fp32 rounding of the exact one (tests/support/parity.py), for each schedule
composed with dp, HSDP, tp/sp, cp
(ring and Ulysses), CPU offload, recomputation and compiled blocks; the gradient norm on every
rank; a checkpoint written by a pipelined run read back by DeepSpeed at one rank and by the Hugging
Face converter. The models have 4 blocks, so that two stages per rank still hold a block each.

Mixture-of-Experts stages (the router losses attached to each stage's output, aux-loss-free bias
balancing beside them) with experts split over ep ranks, 1F1B at ZeRO-3 with recomputation and zbv's
split backward at ZeRO-2, follow the single-rank run too, router metrics included; a zbv checkpoint (experts,
router biases) is read back by DeepSpeed at one rank and the curve goes on."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.composed import composes_runs
from tests.support.helpers import TINY, curve, read_metrics
from tests.support.hf_logits import assert_same_hf_logits
from tests.support.parity import RTOL, assert_deepspeed_continues, assert_exact_norm, assert_parity, exact_references, train_runs
from tests.support.ranks import run_ranks
from tests.support.reference_cache import reference_runs

pytestmark = pytest.mark.slow
SHAPE = ["model.num_layers=4", "parallel.global_batch_size=16"]  # 8 micro-batches of 2 at dp1, 4 at dp2
STEPS = ["train.max_steps=8", "train.eval_interval=4"]
FLAVOURS = {"gpt2": ["model=gpt_tiny", *TINY, *SHAPE], "llama": ["model=llama_tiny", *TINY, *SHAPE],
            "moe": ["model=moe_tiny", *TINY, *SHAPE, "model.moe.bias_update_rate=0.001"]}
ROUTER_KEYS = ("moe/aux_loss", "moe/z_loss", "moe/max_load")
PIPE = ["backend=fsdp2", "parallel.pp=2"]
# four ranks each; gpt2's tied embedding crosses from the last stage to the first (zbv: both on rank 0)
LAYOUTS = {
    "gpt2": {
        "1f1b-dp2-stage3": ["zero=stage3"],
        "interleaved-tp2-sp-stage3": ["zero=stage3", "parallel.pipeline_schedule=interleaved_1f1b",
                                      "parallel.virtual_stages=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
        "zero_bubble-dp2-offload-recompute": ["zero=stage2", "parallel.pipeline_schedule=zero_bubble",
                                              "parallel.virtual_stages=2", "offload=cpu",
                                              "parallel.activation_checkpointing=true"],
        "zbv-hsdp-2x1": ["zero=stage2", "parallel.pipeline_schedule=zbv", "parallel.dp_replicate=2",
                         "train.save_interval=4"],
    },
    "llama": {
        "dualpipev-cp2-ring": ["zero=stage2", "parallel.pipeline_schedule=dualpipev", "parallel.cp=2"],
        "gpipe-cp2-ulysses-stage3": ["zero=stage3", "parallel.pipeline_schedule=gpipe", "parallel.cp=2",
                                     "parallel.cp_impl=ulysses"],
        "interleaved-dp2-compile": ["zero=stage3", "parallel.pipeline_schedule=interleaved_1f1b",
                                    "parallel.virtual_stages=2", "train.compile=true"],
    },
    "moe": {
        "1f1b-dp2-ep2-stage3-recompute": ["zero=stage3", "parallel.ep=2", "parallel.activation_checkpointing=true"],
        "zbv-dp2-ep2": ["zero=stage2", "parallel.pipeline_schedule=zbv", "parallel.ep=2", "train.save_interval=4"],
    },
}


@pytest.fixture(scope="module")
def reference_dirs(tmp_path_factory) -> dict[str, Path]:
    """DeepSpeed's engine at one rank, unpipelined, each flavour, in fp32 (also summing in another
    order) and the same run in float64 (tests/support/parity.py: exact_references)."""
    return exact_references(tmp_path_factory.mktemp("single"), {name: [*base, *STEPS] for name, base in FLAVOURS.items()})


@pytest.mark.parametrize("flavour", sorted(LAYOUTS))
def test_pipeline_schedules_match_the_single_rank_run(flavour, reference_dirs, tmp_path):
    layouts = LAYOUTS[flavour]
    runs = [([*FLAVOURS[flavour], *STEPS, *PIPE, *extra], str(tmp_path / name)) for name, extra in layouts.items()]
    norms = run_ranks(train_runs, 4, tmp_path, runs=runs)
    reference = read_metrics(reference_dirs[flavour])
    # the reference's own rounding per step: the same run summing in another order, and in float64
    order, exact = (read_metrics(reference_dirs[f"{flavour}-{kind}"]) for kind in ("order", "fp64"))
    last_norm = curve(reference, "grad_norm")[-1][1]
    for i, name in enumerate(layouts):
        assert_parity(read_metrics(tmp_path / name), reference, f"fsdp2 {flavour} pp2 {name}", order=order,
                      exact=exact)
        assert_exact_norm(tmp_path / name, reference_dirs, flavour, f"fsdp2 {flavour} pp2 {name}")
        for rank, rank_norms in enumerate(norms):  # each stage's rank, each TP rank: the global norm
            assert rank_norms[i] == pytest.approx(last_norm, rel=RTOL), (name, rank, rank_norms[i], last_norm)
        if flavour == "moe":  # each stage's routers, pooled over the stages
            assert_parity(read_metrics(tmp_path / name), reference, f"fsdp2 moe pp2 {name}", keys=ROUTER_KEYS,
                          order=order, exact=exact)
    if flavour == "moe":  # experts and router biases from a V-shaped pipeline, read by DeepSpeed at one rank
        saved = tmp_path / "zbv-dp2-ep2" / "checkpoints" / "global_step4"
        assert_deepspeed_continues(saved, [*FLAVOURS[flavour], *STEPS], reference, tmp_path,
                                   "fsdp2 moe pp2 zbv -> deepspeed dp1")
    if flavour == "gpt2":
        # written by a V-shaped pipeline (the tied embedding's two copies on rank 0, written once),
        # read by DeepSpeed at one rank, unpipelined: the curve goes on
        assert_deepspeed_continues(tmp_path / "zbv-hsdp-2x1" / "checkpoints" / "global_step4",
                                   [*FLAVOURS[flavour], *STEPS], reference, tmp_path, "fsdp2 pp2 zbv -> deepspeed dp1")


def test_each_schedule_alone_on_two_ranks(reference_dirs, tmp_path):
    """pp2 without data parallelism: 1F1B, interleaved 1F1B and zero-bubble (two stages per rank)."""
    runs = {"1f1b": ["zero=stage3"],
            "interleaved": ["zero=stage3", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
            "zero_bubble": ["zero=stage2", "parallel.pipeline_schedule=zero_bubble", "parallel.virtual_stages=2"]}
    run_ranks(train_runs, 2, tmp_path, runs=[([*FLAVOURS["gpt2"], *STEPS, *PIPE, *extra], str(tmp_path / name))
                                             for name, extra in runs.items()])
    reference = read_metrics(reference_dirs["gpt2"])
    for name in runs:
        assert_parity(read_metrics(tmp_path / name), reference, f"fsdp2 gpt2 pp2 {name}")
        assert_exact_norm(tmp_path / name, reference_dirs, "gpt2", f"fsdp2 gpt2 pp2 {name}")


def test_pp2_tp2_dp2_on_eight_ranks_and_its_checkpoint_in_hugging_face(reference_dirs, tmp_path):
    """The three axes at once, 1F1B with ZeRO-3; the Hugging Face converter reads what eight ranks
    wrote (each stage its layers' boxes) and transformers gives the single-rank run's logits."""
    run = ([*FLAVOURS["gpt2"], *STEPS, *PIPE, "zero=stage3", "parallel.tp=2", "parallel.dp=2"], str(tmp_path / "pp2tp2dp2"))
    norms = run_ranks(train_runs, 8, tmp_path, runs=[run])
    reference = read_metrics(reference_dirs["gpt2"])
    assert_parity(read_metrics(tmp_path / "pp2tp2dp2"), reference, "fsdp2 gpt2 pp2 x tp2 x dp2")
    assert_exact_norm(tmp_path / "pp2tp2dp2", reference_dirs, "gpt2", "fsdp2 gpt2 pp2 x tp2 x dp2")
    last_norm = curve(reference, "grad_norm")[-1][1]
    assert all(rank_norms[0] == pytest.approx(last_norm, rel=RTOL) for rank_norms in norms), (norms, last_norm)
    assert_same_hf_logits(tmp_path / "pp2tp2dp2", reference_dirs["gpt2"], tmp_path)


@composes_runs
def train_reporting_stages(rank: int, world: int, runs: list[tuple[list[str], str]]) -> list[dict[int, int]]:
    """parity.train_runs, returning the blocks of each stage this rank built, by stage index."""
    from megaframe.backends.registry import validate_for_engine
    from megaframe.training.trainer import Trainer
    from tests.support.composed import composed

    built = []
    for overrides, run_dir in runs:
        cfg = composed(overrides)
        with Trainer(cfg, validate_for_engine(cfg, world, ask_bf16=False), Path(run_dir)) as trainer:
            trainer.fit()
            built.append({index: len(stage.blocks) for index, stage in trainer.backend.pipeline.stages.items()})
    return built


def test_stages_cut_by_parameters_follow_the_single_rank_run(tmp_path_factory, tmp_path):
    """parallel.pipeline_partition=parameters: six llama blocks in four stages (interleaved on two
    ranks) are built 1, 2, 2, 1, the ends holding the embedding and the head (uniform: 2, 2, 1, 1),
    and train the single-rank curve."""
    config = [*FLAVOURS["llama"], *STEPS, "model.num_layers=6"]
    reference = reference_runs({"six-blocks": config}, tmp_path_factory.mktemp("six"))["six-blocks"]
    run = [*config, *PIPE, "zero=stage2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2",
           "parallel.pipeline_partition=parameters"]
    built = run_ranks(train_reporting_stages, 2, tmp_path, runs=[(run, str(tmp_path / "parameters"))])
    assert {index: blocks for rank in built for index, blocks in rank[0].items()} == {0: 1, 1: 2, 2: 2, 3: 1}, built
    assert_parity(read_metrics(tmp_path / "parameters"), read_metrics(reference), "fsdp2 llama pp2 v2 by parameters")
