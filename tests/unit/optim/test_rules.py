"""optim's rules before launch (optim/rules.py, through megaframe-train's pre-launch check): where
Muon runs (FSDP2 in every layout, the plain engine at one process), and every engine or setting
where it would step a flattened partition or offloaded state refused in one line naming the key
(exit 2), never trained with a wrong update; its keys' ranges; a Muon key under AdamW."""
from __future__ import annotations

import pytest

from megaframe.config.optim_rules import OPTIMIZERS
from megaframe.launch.checks import check
from megaframe.optim.table import TENSOR_STATE

MUON = ["optim=muon"]


def _refusal(overrides: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as ended:
        check(overrides)
    assert ended.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line.removeprefix("megaframe-train: error: ")


@pytest.mark.parametrize("overrides", [MUON, [*MUON, "backend=fsdp2"],
                                       [*MUON, "backend=fsdp2", "parallel.dp=2"],
                                       [*MUON, "zero=stage1"], [*MUON, "zero=stage1", "parallel.dp=2"],
                                       [*MUON, "zero=stage2", "parallel.dp=2", "precision=bf16"],
                                       [*MUON, "zero=stage3", "parallel.dp=2"],
                                       [*MUON, "model=moe_tiny", "zero=stage1", "parallel.dp=2"]])
def test_muon_runs_where_it_sees_whole_matrices_row_shards_or_described_partitions(overrides):
    cfg, layout, _ = check(overrides)
    assert cfg.optim.name == "muon" and cfg.optim.muon.adamw_lr == 3e-3 and layout.tp == layout.pp == layout.grid.ep == 1


@pytest.mark.parametrize("overrides", [[*MUON, "zero=stage1", "parallel.tp=2", "parallel.dp=2",
                                        "parallel.sequence_parallel=true"],
                                       [*MUON, "zero=stage3", "parallel.tp=2", "parallel.dp=2"],
                                       [*MUON, "zero=stage1", "parallel.pp=2", "parallel.dp=2"]])
def test_muon_runs_under_zero_with_tensor_parallelism_and_the_pipeline(overrides):
    """ZeRO's partitions of TP pieces are described as ranges of each piece's box, and each pipeline
    stage's as its own (muon_zero.py; trained in tests/dist/test_muon_zero.py)."""
    cfg, layout, _ = check(overrides)
    assert cfg.optim.name == "muon" and layout.tp * layout.pp == 2 and cfg.zero.stage in (1, 3)


FLAT = "optim=muon with backend=deepspeed: its ZeRO and mixed-precision optimizers step flattened partitions"
FSDP2 = [*MUON, "backend=fsdp2"]


@pytest.mark.parametrize("overrides, axis", [
    ([*FSDP2, "parallel.tp=2", "parallel.sequence_parallel=true"], "tp"),
    ([*FSDP2, "parallel.pp=2"], "pp"),
    ([*FSDP2, "parallel.cp=2"], "cp"),
    ([*FSDP2, "model=moe_tiny", "parallel.ep=2", "parallel.dp=2"], "ep"),
    ([*FSDP2, "parallel.dp=4", "parallel.dp_replicate=2", "parallel.micro_batch_size=2",
      "parallel.global_batch_size=32"], "dp_replicate"),
])
def test_muon_runs_on_fsdp2_in_every_layout(overrides, axis):
    """FSDP2 hands Muon tensors it can assemble whole matrices from in every layout (TP pieces over tp
    x the shard group, expert rows over edp, each stage's and replica's own): nothing refused."""
    cfg, layout, _ = check(overrides)
    assert cfg.optim.name == "muon" and getattr(layout.grid, axis) == 2


@pytest.mark.parametrize("overrides, says", [
    ([*MUON, "parallel.dp=2"], FLAT),
    ([*MUON, "parallel.dp=2", "zero=stage0"], FLAT + ", not whole matrices; megaframe locates matrices in them at "
                                                      "zero=stage1, stage2 and stage3 only (zero.stage=0)"),
    ([*MUON, "zero=stage2", "offload=cpu"], "optim=muon with offload.optimizer=cpu: "),
    ([*MUON, "zero=stage3", "offload.param=cpu"], "optim=muon with offload.param=cpu: "),
    ([*MUON, "precision=bf16"], FLAT),
    ([*MUON, "parallel.tp=2"], FLAT),  # DeepSpeed's engine at more than one process
    ([*MUON, "backend=fsdp2", "offload=cpu"], "optim=muon with offload.optimizer=cpu: "),
    ([*MUON, "optim.muon.ns_steps=0"], "optim.muon.ns_steps=0 must be in [1, 99]"),
    ([*MUON, "optim.muon.momentum=1.0"], "optim.muon.momentum=1.0 must be in [0, 1)"),
    ([*MUON, "optim.muon.adjust_lr=rms"], "optim.muon.adjust_lr='rms' is not one of ['spectral', 'match_rms_adamw']"),
    ([*MUON, "optim.muon.ns_coefficients=[1,2]"], "optim.muon.ns_coefficients=[1.0, 2.0] must be three finite numbers"),
    ([*MUON, "optim.muon.ns_coefficients=[1e300,1,1]"], "optim.muon.ns_coefficients=[1e+300, 1.0, 1.0] must be three "
                                                        "finite numbers (a, b, c) within fp32's range"),
    ([*MUON, "optim.muon.exchange_bucket_size=-1"], "optim.muon.exchange_bucket_size=-1 must be a whole number"),
    ([*MUON, "optim.muon.exchange_bucket_size=1e9"], "optim.muon.exchange_bucket_size"),
    (["optim.muon.momentum=0.9"], "optim.muon.momentum is read only under optim=muon"),
    (["optim.name=sgd"], "optim.name='sgd' is not one of ['adamw', 'muon']"),
])
def test_what_muon_cannot_do_is_one_line_before_launch(overrides, says, capsys):
    line = _refusal(overrides, capsys)
    assert line.startswith(says), line


def test_every_optimizer_the_config_accepts_names_its_state():
    """optim.name's choices are the optimizers whose state the checkpoint can store by name."""
    assert set(OPTIMIZERS) == set(TENSOR_STATE)
