"""precision.fp8's refusals before launch (config/fp8_rules.py), each one line naming the key and
the fix: through validate() in-process, the device rules with a faked GPU capability (this host has
none), and through megaframe-train's pre-launch check (exit code 2) for a bad key and a missing
torchao."""
from __future__ import annotations

import sys

import pytest

from megaframe.config.compose import compose
from megaframe.config.fp8_rules import fp8_device_problem
from megaframe.config.validate import ConfigError, validate
from megaframe.launch.checks import check

A100, H100, B200 = (8, 0), (9, 0), (10, 0)


def _cfg(*overrides: str):
    return compose(["precision=fp8", *overrides])[0]


@pytest.mark.parametrize("overrides,message", [
    (["precision.fp8.recipe=fp4"], "precision.fp8.recipe='fp4' is not one of ['tensorwise', 'rowwise', "
                                   "'rowwise_with_gw_hp', 'mxfp8']"),
    (["precision.fp8.emulate=sometimes"], "precision.fp8.emulate='sometimes' is not one of"),
    (["precision.dtype=fp16"], "precision.fp8 with precision.dtype=fp16"),
    (["precision.fp8.bf16_layers=2"], "precision.fp8.bf16_layers=2 keeps the first and last that many of the 4 "
                                      "blocks in bf16, leaving none in fp8; use 0 <= bf16_layers < 2"),
    (["precision.fp8.bf16_layers=-1"], "precision.fp8.bf16_layers=-1 must be >= 0"),
    (["precision.fp8.recipe=mxfp8", "model.hidden_size=48", "model.num_attention_heads=4"],
     "precision.fp8.recipe=mxfp8 scales blocks of 32 along each matmul's reduction dimension, and "
     "model.hidden_size is 48"),
    (["precision.fp8.recipe=mxfp8", "model.ffn_hidden_size=96", "parallel.tp=2"],
     "the MLP width / parallel.tp is 48"),
])
def test_a_bad_fp8_config_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(*overrides), 2 if "parallel.tp=2" in overrides else 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mxfp8_checks_the_widths_the_model_has():
    """moe_tiny's dense MLP width (352 / tp=2 = 176) is never built (every block routes): accepted;
    its experts' width is checked."""
    moe = ["model=moe_tiny", "precision.fp8.recipe=mxfp8", "parallel.tp=2"]
    validate(_cfg(*moe), 2)
    with pytest.raises(ConfigError, match="the expert MLP width is 48"):
        validate(_cfg(*moe, "model.moe.ffn_hidden_size=48"), 2)
    with pytest.raises(ConfigError, match="the MLP width / parallel.tp is 176"):
        validate(_cfg(*moe, "model.moe.first_dense_layers=1"), 2)


def test_fp8_with_bf16_layers_left_over_and_every_recipe_is_accepted():
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"):
        validate(_cfg(f"precision.fp8.recipe={recipe}", "model.num_layers=3", "precision.fp8.bf16_layers=1"), 1,
                 fp8_device=lambda: None)
    # fp8 off: its keys are still checked (a typo waits for the day it is switched on), its needs are not
    with pytest.raises(ConfigError, match="precision.fp8.recipe='nonsense'"):
        validate(compose(["precision=bf16", "precision.fp8.recipe=nonsense"])[0], 1)
    validate(compose(["precision=bf16"])[0], 1, fp8_device=lambda: (7, 0))  # fp8 off: no fp8 tensor cores needed


@pytest.mark.parametrize("key", ["precision.fp8.recipe=mxfp8", "precision.fp8.head=true", "precision.fp8.bf16_layers=1",
                                 "model.moe.top_k=4", "model.moe.capacity_factor=1.0"])
def test_a_key_of_a_feature_that_is_off_is_refused_not_ignored(key):
    """fp8 recipes and MoE keys set without precision=fp8 or experts trained the plain model, exit 0,
    with the default run's loss to the last digit (feature review); optim.muon's keys were refused so."""
    name = key.split("=")[0]
    with pytest.raises(ConfigError) as err:
        validate(compose(["precision=bf16", key])[0], 1)
    switch = "precision=fp8" if "fp8" in key else "experts (model.moe.num_experts > 0)"
    assert str(err.value).startswith(f"{name} is read only with {switch}"), str(err.value)
    validate(compose(["precision=fp8" if "fp8" in key else "model=moe_tiny", key])[0], 1, fp8_device=lambda: None)


@pytest.mark.parametrize("recipe,emulate,capability,refused", [
    ("tensorwise", "auto", A100, "needs fp8 tensor cores (SM 8.9 or later) and this GPU is SM 8.0"),
    ("rowwise", "false", A100, "needs fp8 tensor cores"),
    ("tensorwise", "true", A100, None),  # emulation asked: slow, but it computes
    ("tensorwise", "auto", H100, None),
    ("mxfp8", "auto", H100, "needs MXFP8 tensor cores (SM 10.0 or later) and this GPU is SM 9.0"),
    ("mxfp8", "true", H100, None),
    ("mxfp8", "auto", B200, None),
    ("mxfp8", "auto", None, None),  # the CPU: auto emulates
    ("mxfp8", "false", None, "precision.fp8.emulate=false needs a GPU of SM 10.0"),
    ("tensorwise", "false", None, None),  # torch._scaled_mm runs tensorwise and rowwise on the CPU
])
def test_the_gpu_must_have_fp8_tensor_cores_unless_emulation_is_asked(recipe, emulate, capability, refused):
    cfg = _cfg(f"precision.fp8.recipe={recipe}", f"precision.fp8.emulate={emulate}")
    problem = fp8_device_problem(cfg, capability)
    assert problem == refused if refused is None else refused in problem and "\n" not in problem
    if refused:  # and validate() asks the device through its fp8_device hook
        with pytest.raises(ConfigError, match="tensor cores|SM 10.0"):
            validate(cfg, 1, fp8_device=lambda: capability)


@pytest.mark.parametrize("overrides, dimension", [
    (["model.hidden_size=72"], "model.hidden_size is 72"),
    (["model.seq_length=100", "parallel.micro_batch_size=1", "parallel.global_batch_size=2"],
     "parallel.micro_batch_size x model.seq_length / parallel.cp (the tokens a linear takes) is 100"),
    (["model.ffn_hidden_size=200"], "the MLP width / parallel.tp is 200"),
])
def test_fp8_kernels_need_every_dimension_a_multiple_of_16(overrides, dimension):
    """On a GPU's fp8 kernels (simulated H100: _scaled_mm's 'mat2 shape (72x72) must be divisible by 16'
    at step 0, exit 1); emulated, or on the CPU, any size computes."""
    with pytest.raises(ConfigError) as err:
        validate(_cfg(*overrides), 1, fp8_device=lambda: H100)
    assert f"needs every dimension of a matmul a multiple of 16, and {dimension}" in str(err.value), str(err.value)
    validate(_cfg(*overrides, "precision.fp8.emulate=true"), 1, fp8_device=lambda: H100)
    validate(_cfg(*overrides), 1, fp8_device=lambda: None)


def test_rowwise_with_a_high_precision_weight_gradient_takes_any_token_count():
    """Its weight gradient (where the tokens are the reduction) is a bf16 GEMM: 100 tokens run (review)."""
    tokens = ["model.seq_length=100", "parallel.micro_batch_size=1", "parallel.global_batch_size=2"]
    validate(_cfg(*tokens, "precision.fp8.recipe=rowwise_with_gw_hp"), 1, fp8_device=lambda: H100)
    with pytest.raises(ConfigError, match="the tokens a linear takes"):
        validate(_cfg(*tokens, "precision.fp8.recipe=rowwise"), 1, fp8_device=lambda: H100)


def test_megaframe_train_refuses_before_launch_with_exit_2(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        check(["precision=fp8", "precision.fp8.recipe=fp4", "backend=fsdp2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "precision.fp8.recipe='fp4'" in err
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if torchao were not installed
    with pytest.raises(SystemExit) as exit_:
        check(["precision=fp8", "backend=fsdp2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "precision=fp8 needs torchao" in err and "megaframe[fp8]" in err


def test_fp8_kernels_without_compile_are_said_once_at_start_up():
    """Eager fp8 (an amax, a scale and a cast per tensor per linear, unfused) is slower than bf16 on an
    H100; emulation on the CPU is what the tests run, and a compiled run fuses the casts."""
    from megaframe.config.fp8_rules import eager_fp8_warning

    cfg, _ = compose(["precision=fp8"])
    assert "set train.compile=true" in eager_fp8_warning(cfg, "cuda")
    assert eager_fp8_warning(cfg, "cpu") is None  # emulate=auto: dequantised bf16 matmuls on the CPU
    compiled, _ = compose(["precision=fp8", "train.compile=true"])
    assert eager_fp8_warning(compiled, "cuda") is None
    assert eager_fp8_warning(compose(["precision=bf16"])[0], "cuda") is None
