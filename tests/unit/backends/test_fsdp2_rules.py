"""backend=fsdp2's config rules (backends/fsdp2/rules.py): what maps onto fully_shard and what is
refused before launch, each refusal one line naming the key and what to use instead."""
from __future__ import annotations

import pytest

from megaframe.launch.checks import check

FSDP2 = ["backend=fsdp2"]


def _refusal(overrides: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ended:
        check([*FSDP2, *overrides])
    assert ended.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line.removeprefix("megaframe-train: error: ")


@pytest.mark.parametrize("overrides", [["zero=stage3"], ["zero=stage2"], ["zero=stage3", "precision=bf16"],
                                       ["zero=stage3", "offload=cpu"], ["zero=stage2", "offload=cpu", "offload.param=cpu"],
                                       ["zero=stage3", "parallel.tp=2", "parallel.sequence_parallel=true",
                                        "parallel.dp=2"],
                                       ["zero=stage3", "parallel.cp=2", "parallel.cp_impl=ulysses", "parallel.dp=2"],
                                       ["zero=stage3", "offload.pin_memory=true"],
                                       ["zero=stage3", "parallel.dp=4", "parallel.dp_replicate=2",
                                        "parallel.global_batch_size=32", "parallel.micro_batch_size=2"],
                                       ["zero=stage3", "model=moe_tiny", "parallel.dp=4", "parallel.ep=2",
                                        "parallel.global_batch_size=32"],
                                       ["zero=stage3", "parallel.pp=2"],
                                       ["zero=stage3", "parallel.pp=2", "parallel.pipeline_schedule=interleaved_1f1b",
                                        "parallel.virtual_stages=2"],
                                       ["zero=stage2", "parallel.pp=2", "parallel.pipeline_schedule=zbv"],
                                       ["zero=stage2", "parallel.pp=2", "parallel.pipeline_schedule=dualpipev",
                                        "parallel.virtual_stages=2", "parallel.micro_batch_size=4"]])
def test_what_fsdp2_runs_passes(overrides):
    cfg, layout, _ = check([*FSDP2, *overrides])
    assert cfg.backend.name == "fsdp2"


@pytest.mark.parametrize("overrides,says", [
    (["zero=stage0"], "zero.stage=0 with backend=fsdp2: FSDP2 always shards gradients and optimizer states; use zero=stage2"),
    (["zero=stage1"], "zero.stage=1 with backend=fsdp2"),
    (["zero=stage3", "precision=fp16"], "precision=fp16 with backend=fsdp2: it has no loss scaler; use precision=bf16"),
    (["zero=stage3", "offload=nvme", "offload.nvme_path=/tmp"], "offload=nvme with backend=fsdp2"),
    (["zero=stage3", "offload.param=cpu"], "offload.param=cpu with backend=fsdp2"),
    (["zero=stage3", "parallel.pp=2", "parallel.pipeline_schedule=looped"],
     "parallel.pipeline_schedule='looped' is not a schedule; choose one of 1f1b, gpipe, interleaved_1f1b"),
    (["zero=stage3", "parallel.pp=2", "parallel.virtual_stages=2"],
     "parallel.pipeline_schedule=1f1b runs one stage per rank; use parallel.virtual_stages=1"),
    (["zero=stage3", "parallel.pp=2", "parallel.pipeline_schedule=zero_bubble", "parallel.virtual_stages=2"],
     "parallel.pipeline_schedule=zero_bubble with zero=stage3: its split backward computes weight gradients after"),
    (["zero=stage2", "parallel.pp=2", "parallel.pipeline_schedule=zbv", "parallel.virtual_stages=3"],
     "parallel.pipeline_schedule=zbv runs two stages per rank in a V; use parallel.virtual_stages=2"),
    (["zero=stage2", "parallel.pp=2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=4"],
     "parallel.pp=2 x 4 stages per rank (interleaved_1f1b) makes 8 stages for model.num_layers=4"),
    (["zero=stage2", "parallel.pp=2", "parallel.micro_batch_size=4", "parallel.global_batch_size=4"],
     "parallel.pipeline_schedule=1f1b at parallel.pp=2 cannot run 1 micro-batches per step (parallel.global_batch_size "
     "/ (micro_batch_size x dp)); set parallel.global_batch_size=8 (2 micro-batches)"),
    (["zero=stage2", "parallel.pp=2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2",
      "parallel.micro_batch_size=4", "parallel.global_batch_size=20"],
     "parallel.pipeline_schedule=interleaved_1f1b at parallel.pp=2 cannot run 5 micro-batches per step"),
    (["zero=stage2", "parallel.pp=2", "parallel.pipeline_schedule=dualpipev", "parallel.micro_batch_size=4",
      "parallel.global_batch_size=12"],
     "parallel.pipeline_schedule=dualpipev at parallel.pp=2 cannot run 3 micro-batches per step (parallel.global_batch_size "
     "/ (micro_batch_size x dp)); set parallel.global_batch_size=16 (4 micro-batches)"),
    (["zero=stage3", "train.native_checkpoint=true"], "backend=fsdp2 writes layout-free checkpoints only"),
    (["zero=stage3", "train.universal_checkpoint=false"], "backend=fsdp2 writes layout-free checkpoints only"),
    (["zero=stage3", "zero.reduce_bucket_size=1000"], "zero.reduce_bucket_size=1000 is a DeepSpeed setting"),
    (["zero=stage3", "offload.aio_queue_depth=4"], "offload.aio_queue_depth=4 is a DeepSpeed setting"),
])
def test_what_fsdp2_cannot_do_is_one_line_before_launch(overrides, says, capsys):
    line = _refusal(overrides, capsys)
    assert line.startswith(says), line


@pytest.mark.parametrize("overrides,stage", [(FSDP2, 3), ([*FSDP2, "zero=stage2"], 2), ([*FSDP2, "zero.stage=2"], 2),
                                             ([], 0), (["backend=deepspeed"], 0), (["zero=stage1"], 1)])
def test_each_engine_has_its_own_default_stage(overrides, stage):
    """backend=fsdp2 alone shards fully (ZeRO-3), as torchtitan users expect; DeepSpeed keeps its
    stage 0; a stage the command names wins under either engine (issue 51)."""
    cfg, _, _ = check(overrides)
    assert cfg.zero.stage == stage


def test_the_stage_refusal_names_both_ways_out(capsys):
    line = _refusal(["zero=stage1"], capsys)
    assert "zero=stage2" in line and "zero=stage3" in line and "backend=deepspeed" in line


def test_hsdp_replicas_must_divide_the_data_parallel_ranks(capsys):
    line = _refusal(["zero=stage3", "parallel.dp=4", "parallel.dp_replicate=3", "parallel.micro_batch_size=2",
                     "parallel.global_batch_size=32"], capsys)
    assert line == ("parallel.dp_replicate=3 must divide the 4 data-parallel ranks (dp x cp) into equal shard groups; "
                    "pick it in [1, 2, 4]")


def test_deepspeed_refuses_hsdp_naming_fsdp2(capsys):
    with pytest.raises(SystemExit):
        check(["zero=stage3", "parallel.dp=4", "parallel.dp_replicate=2", "parallel.micro_batch_size=2",
               "parallel.global_batch_size=32"])
    line = capsys.readouterr().err.strip()
    assert "parallel.dp_replicate=2" in line and "backend=fsdp2" in line and "\n" not in line


def test_deepspeed_refuses_torch_schedules_naming_fsdp2(capsys):
    with pytest.raises(SystemExit):
        check(["parallel.pp=2", "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_stages=2"])
    line = capsys.readouterr().err.strip()
    assert "DeepSpeed's pipeline engine runs 1f1b" in line and "backend=fsdp2" in line and "\n" not in line
