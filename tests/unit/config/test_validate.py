"""The validation rules on typed configs, without processes."""
from __future__ import annotations

import re

import pytest

from megaframe.config.schema import TrainConfig
from megaframe.config.validate import (ConfigError, ffn_hidden_size, padded_vocab_size, requested_world_size,
                                       resolve_layout, validate)


def _never_fp16() -> bool:
    return False


def test_default_config_is_valid_and_resolves_dp_from_world():
    cfg = TrainConfig()
    assert validate(cfg, 1, _never_fp16).dp == 1
    layout = validate(cfg, 4, _never_fp16)
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (1, 1, 4, 4)
    assert layout.grad_accum_steps == cfg.parallel.global_batch_size // (cfg.parallel.micro_batch_size * 4)


def test_requested_world_size_counts_every_axis():
    cfg = TrainConfig()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = 2, 3, 4
    assert requested_world_size(cfg) == 24
    cfg.parallel.dp = None
    assert requested_world_size(cfg) == 6


def test_hsdp_replicas_are_an_axis_of_the_resolved_grid():
    """parallel.dp_replicate is the grid's dp_replicate (the engine reads it there), refused in one line
    before the grid exists when it does not divide the dp x cp ranks; with cp=2 the error names the cp factor."""
    cfg = TrainConfig()
    cfg.parallel.cp, cfg.parallel.dp_replicate = 2, 4
    grid = resolve_layout(cfg, 4).grid
    assert (grid.dp, grid.cp, grid.dp_replicate, grid.dp_shard) == (2, 2, 4, 1)
    with pytest.raises(ConfigError, match=re.escape("parallel.dp_replicate=4 must divide the 2 data-parallel ranks "
                                                    "(dp x cp) into equal shard groups; pick it in [1, 2]")):
        resolve_layout(cfg, 2)
    cfg.parallel.dp = 3
    with pytest.raises(ConfigError, match=re.escape("parallel.tp*parallel.pp*parallel.cp*parallel.dp=1*1*2*3=6 but "
                                                    "the world size is 4; set parallel.dp=2 or launch 6 ranks")):
        resolve_layout(cfg, 4)


def test_explicit_dp_must_match_world():
    cfg = TrainConfig()
    cfg.parallel.dp = 2
    with pytest.raises(ConfigError, match=r"world size is 4; set parallel.dp=4"):
        resolve_layout(cfg, 4)


def test_fp16_rule_asks_the_device():
    cfg = TrainConfig()
    cfg.precision.dtype = "fp16"
    with pytest.raises(ConfigError, match="no fp16 support"):
        validate(cfg, 1, _never_fp16)
    assert validate(cfg, 1, lambda: True).world_size == 1


def test_bf16_rule_asks_the_device():
    cfg = TrainConfig()
    cfg.precision.dtype = "bf16"
    with pytest.raises(ConfigError, match=r"no native bf16 .*sm80.*precision=fp16"):
        validate(cfg, 1, _never_fp16, lambda: False)
    assert validate(cfg, 1, _never_fp16, lambda: True).world_size == 1


@pytest.mark.parametrize("capability, native", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_counts_bf16_as_native_from_ampere(monkeypatch, capability, native):
    """torch.cuda.is_bf16_supported() says yes on a V100 (emulation); the rule must not."""
    import torch

    from megaframe.backends.deepspeed import accelerator

    class Cuda:
        def device_name(self):
            return "cuda"

        def is_bf16_supported(self):
            return True  # what DeepSpeed's CUDA accelerator answers through torch on any GPU

    monkeypatch.setattr(accelerator, "get_accelerator", Cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert accelerator.device_supports_bf16() is native


def test_pipeline_rules():
    cfg = TrainConfig()  # 2 layers
    cfg.parallel.pp, cfg.zero.stage = 2, 1
    assert validate(cfg, 2, _never_fp16).pp == 2
    cfg.parallel.pp = 3
    with pytest.raises(ConfigError, match="parallel.pp=3 exceeds model.num_layers=2"):
        validate(cfg, 3, _never_fp16)


def test_tensor_parallel_rules():
    cfg = TrainConfig()  # 4 heads, ffn 4*64
    cfg.parallel.tp = 4
    assert validate(cfg, 4, _never_fp16).tp == 4
    cfg.model.num_kv_heads = 2  # fewer kv heads than TP ranks: replicated, allowed
    assert validate(cfg, 4, _never_fp16).tp == 4
    cfg.parallel.tp = 3
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide model.num_attention_heads=4; pick tp in \[1, 2, 4\]"):
        validate(cfg, 3, _never_fp16)
    cfg.parallel.tp, cfg.model.ffn_hidden_size = 2, 255
    with pytest.raises(ConfigError, match="parallel.tp=2 does not divide model.ffn_hidden_size=255"):
        validate(cfg, 2, _never_fp16)
    cfg.model.ffn_hidden_size, cfg.parallel.sequence_parallel, cfg.model.seq_length = 256, True, 33
    with pytest.raises(ConfigError, match="model.seq_length=33 divisible by parallel.tp=2"):
        validate(cfg, 2, _never_fp16)
    cfg.parallel.tp = 1
    with pytest.raises(ConfigError, match="sequence_parallel=true needs parallel.tp > 1"):
        validate(cfg, 1, _never_fp16)


def test_derived_sizes():
    cfg = TrainConfig()
    cfg.model.hidden_size = 96
    assert ffn_hidden_size(cfg.model) == 384
    cfg.model.activation = "swiglu"
    assert ffn_hidden_size(cfg.model) == 256  # 8*96/3 = 256, already a multiple of 64
    assert padded_vocab_size(257, 128, 1) == 384
    assert padded_vocab_size(50257, 128, 8) == 51200  # GPT-2's vocabulary under Megatron, TP 8


def test_vocab_padding_by_default_serves_the_device():
    """model.make_vocab_size_divisible_by=null: tensor-core tiles on a GPU, only TP's equal shards on a CPU."""
    assert TrainConfig().model.make_vocab_size_divisible_by is None
    assert padded_vocab_size(257, None, 1, "cuda") == 384
    assert padded_vocab_size(50257, None, 8, "cuda") == 51200
    assert padded_vocab_size(257, None, 1, "cpu") == 257
    assert padded_vocab_size(257, None, 2, "cpu") == 258  # two equal vocabulary shards
    assert padded_vocab_size(257, 64, 1, "cpu") == 320  # an explicit multiple holds anywhere
    cfg = TrainConfig()
    cfg.model.make_vocab_size_divisible_by = 0
    with pytest.raises(ConfigError, match="model.make_vocab_size_divisible_by=0"):
        validate(cfg, 1)


@pytest.mark.parametrize("key,value,fragment", [
    ("hysteresis", 0, "precision.hysteresis=0 must be >= 1"),
    ("min_loss_scale", 0.0, "precision.min_loss_scale=0.0 must be > 0"),
])
def test_loss_scaling_knobs_are_checked(key, value, fragment):
    cfg = TrainConfig()
    cfg.precision.dtype = "fp16"
    setattr(cfg.precision, key, value)
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        validate(cfg, 1, lambda: True)


def test_keep_checkpoints_must_not_be_negative():
    cfg = TrainConfig()
    cfg.train.keep_checkpoints = -1
    with pytest.raises(ConfigError, match=r"train.keep_checkpoints=-1 must be >= 0 \(0 keeps every checkpoint\)"):
        validate(cfg, 1, _never_fp16)


def test_a_resume_path_that_is_a_file_says_so_and_names_its_checkpoint(tmp_path):
    """It said "no such checkpoint directory" of a file that is there (a checkpoint's state.json)."""
    checkpoint = tmp_path / "global_step4"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    cfg = TrainConfig()
    file = "a file, not a checkpoint directory; pass "
    (checkpoint / "shards").mkdir()
    (checkpoint / "shards" / "rank0.safetensors").write_bytes(b"")
    for path, expected in ((checkpoint / "state.json", f"{file}its checkpoint, train.resume={checkpoint}$"),
                           (checkpoint / "shards" / "rank0.safetensors", f"{file}its checkpoint, "
                                                                         f"train.resume={checkpoint}$"),
                           (tmp_path / "notes.txt", f"{file}a checkpoint's directory \\(global_stepN\\) or a run's"),
                           (tmp_path / "absent", "no such checkpoint directory")):
        cfg.train.resume = str(path)
        with pytest.raises(ConfigError, match=f"^train.resume='{path}': " + expected):
            validate(cfg, 1, _never_fp16)
    cfg.train.resume = str(checkpoint)
    validate(cfg, 1, _never_fp16)


@pytest.mark.parametrize("world, refused", [(2, False), (8, False), (16, False), (12, True)])
def test_a_slurm_job_without_nodes_is_whole_nodes_or_part_of_one(world, refused):
    cfg = TrainConfig()
    cfg.launcher.name, cfg.parallel.global_batch_size = "slurm", 192
    cfg.cluster.gpus_per_node, cfg.cluster.memory_gb = 8, 80.0
    if refused:
        with pytest.raises(ConfigError, match="launcher=slurm: the layout's 12 ranks do not fill nodes of "
                                              "cluster.gpus_per_node=8"):
            validate(cfg, world, _never_fp16)
    else:
        assert validate(cfg, world, _never_fp16).world_size == world


def test_ray_connect_timeout_must_be_positive():
    cfg = TrainConfig()
    cfg.launcher.name, cfg.launcher.connect_timeout_s = "ray", 0
    with pytest.raises(ConfigError, match=r"launcher.connect_timeout_s=0 must be > 0"):
        validate(cfg, 1, _never_fp16)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("group,key,value,fragment", [
    # each was accepted and failed after launch with an exception name (or blamed another key)
    ("optim", "eps", 0.0, "optim.eps=0.0 must be a finite number > 0"),
    ("optim", "lr", NAN, "optim.lr=nan must be a finite number > 0"),
    ("optim", "weight_decay", NAN, "optim.weight_decay=nan must be a finite number >= 0"),
    ("optim", "grad_clip", INF, "optim.grad_clip=inf must be a finite number >= 0"),
    ("train", "collective_timeout_s", INF, "train.collective_timeout_s=inf must be a finite number of seconds"),
    ("train", "join_timeout_s", 0.0, "train.join_timeout_s=0.0 must be a finite number of seconds > 0"),
    ("train", "seed", -1, "train.seed=-1 must be in [0, 2**32)"),
    ("train", "on_batch_size_change", "ignore", "train.on_batch_size_change='ignore'"),
    ("model", "init_std", NAN, "model.init_std=nan must be a finite number > 0"),
    ("model", "norm_eps", 0.0, "model.norm_eps=0.0 must be a finite number > 0"),
    ("model", "rope_theta", 0.0, "model.rope_theta=0.0 must be a finite number > 0"),
    ("cluster", "peak_tflops", -5.0, "cluster.peak_tflops=-5.0 must be a finite number > 0, or null"),
    ("cluster", "reserved_gb", -1.0, "cluster.reserved_gb=-1.0 must be a finite number >= 0"),
    ("cluster", "inter_node_gbps", 0.0, "cluster.inter_node_gbps=0.0 must be a finite number > 0"),
    ("cluster", "peak_tflops", NAN, "cluster.peak_tflops=nan must be a finite number > 0"),
    ("cluster", "gpu", "H100-SXM", "cluster.gpu=H100-SXM: no dense peaks known for it (known: H100 PCIe, H100, H200, B200, "
                                   "A100); set cluster.peak_tflops instead"),
])
def test_values_that_failed_only_after_launch_are_refused_naming_the_key(group, key, value, fragment):
    cfg = TrainConfig()
    setattr(getattr(cfg, group), key, value)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        validate(cfg, 1, _never_fp16)


def test_evaluating_zero_batches_is_refused_unless_evaluation_is_off():
    cfg = TrainConfig()
    cfg.train.eval_steps, cfg.train.eval_interval = 0, 10
    with pytest.raises(ConfigError, match=r"train\.eval_steps=0 with train\.eval_interval=10"):
        validate(cfg, 1, _never_fp16)
    cfg.train.eval_interval = 0
    validate(cfg, 1, _never_fp16)


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "cache").write_text("not a folder")
    cfg = TrainConfig()
    cfg.data.cache_dir = str(tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"data\.cache_dir=.* is a file, not a directory"):
        validate(cfg, 1, _never_fp16)


@pytest.mark.parametrize("train, said", [
    ({"fast_save_interval": -1}, "train.fast_save_interval=-1 must be >= 0"),
    ({"fast_save_interval": 1, "universal_checkpoint": False}, "set train.universal_checkpoint=true"),
    ({"fast_save_interval": 1, "async_save": True}, "set train.async_save=false"),
    ({"fast_save_interval": 1, "fast_save_dir": " "}, "train.fast_save_dir is empty"),
])
def test_the_fast_tier_keys_are_refused_in_one_line(train, said):
    from megaframe.config.validate import check_fast_tier

    cfg = TrainConfig()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    assert said in check_fast_tier(cfg.train)
    cfg.train = TrainConfig().train
    cfg.train.fast_save_interval = 1
    assert check_fast_tier(cfg.train) is None


def test_a_validation_path_beside_a_blend_names_the_blends_form(tmp_path):
    from megaframe.config.validate import check_data

    cfg = TrainConfig()
    cfg.data.blend, cfg.data.valid_path = [1.0, str(tmp_path / "a")], str(tmp_path / "v")
    assert check_data(cfg) == (f"data.valid_path={tmp_path / 'v'} is for data.path; with data.blend name the "
                               f"validation sources in data.valid_blend='[1.0,{tmp_path / 'v'}]'")
    cfg.data.blend, cfg.data.valid_fraction = None, 0.0  # all data trains; the validation file evaluates
    problem = check_data(cfg)
    assert problem is not None and problem.startswith(f"data.valid_path={tmp_path / 'v'}")  # its files are missing


@pytest.mark.parametrize("overrides, message", [
    ({"compile_scope": "graph"}, "train.compile_scope='graph'"),
    ({"compile_scope": "model"}, "train.compile_scope=model says what train.compile compiles; set train.compile=true"),
    ({"compile_scope": "model", "compile": True, "tp": 2},
     "train.compile_scope=model compiles the whole forward as one graph, which tp=2 cannot run in; use "
     "train.compile_scope=blocks"),
    ({"compile_scope": "model", "compile": True, "zero": 3},
     "train.compile_scope=model compiles the whole forward as one graph, which backend=deepspeed zero=3 cannot "
     "run in; use train.compile_scope=blocks"),
])
def test_whole_model_compile_only_where_one_process_runs_the_forward(overrides, message):
    cfg = TrainConfig()
    cfg.train.compile_scope = overrides["compile_scope"]
    cfg.train.compile = overrides.get("compile", False)
    cfg.parallel.tp = overrides.get("tp", 1)
    cfg.zero.stage = overrides.get("zero", 0)
    with pytest.raises(ConfigError) as err:
        validate(cfg, cfg.parallel.tp)
    assert message in str(err.value)
    cfg.parallel.tp, cfg.zero.stage, cfg.train.compile, cfg.train.compile_scope = 1, 1, True, "model"
    assert validate(cfg, 2).dp == 2  # dp-only at ZeRO-1: allowed


def test_a_data_path_naming_a_folder_says_so_and_names_a_dataset_in_it(tmp_path):
    """data.path=newdata/ looked for newdata/.bin and advised building it with that same prefix."""
    import dataclasses

    from megaframe.config.validate import validate

    folder = tmp_path / "newdata"
    folder.mkdir()
    for suffix in (".bin", ".idx"):
        (folder / f"corpus{suffix}").write_bytes(b"")
    for given in (f"{folder}/", str(folder)):
        cfg = TrainConfig()
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=given))
        with pytest.raises(ConfigError) as err:
            validate(cfg, 1, fp16_supported=lambda: False)
        assert str(err.value) == (f"data.path={given}: {given} names a folder, not a dataset; a dataset is named by "
                                  f"the prefix of its files, e.g. {folder / 'corpus'} (there: corpus)")


def test_a_data_path_naming_a_file_says_what_to_name_instead(tmp_path):
    """A newcomer's data.path=input.txt (text, not tokenized) or data.path=data/docs.bin (a dataset's
    file) was told that input.txt.bin was not found and to build it with --output-prefix input.txt."""
    import dataclasses

    from megaframe.config.validate import validate

    (tmp_path / "input.txt").write_text("some text\n")
    for suffix in (".bin", ".idx"):
        (tmp_path / f"docs{suffix}").write_bytes(b"")
    cases = {
        f"{tmp_path}/input.txt": f"{tmp_path}/input.txt is text, not a dataset: tokenize it first with "
                                 f"'megaframe-preprocess --input {tmp_path}/input.txt --output-prefix data/input', "
                                 f"then name data/input",
        f"{tmp_path}/docs.bin": f"{tmp_path}/docs.bin is one of a dataset's files; name the dataset by their prefix: "
                                f"{tmp_path}/docs",
    }
    for given, message in cases.items():
        for key in ("path", "valid_path"):
            cfg = TrainConfig()
            data = dataclasses.replace(cfg.data, **({"path": given} if key == "path" else
                                                    {"path": f"{tmp_path}/docs", "valid_path": given}))
            with pytest.raises(ConfigError) as err:
                validate(dataclasses.replace(cfg, data=data), 1, fp16_supported=lambda: False)
            assert str(err.value) == f"data.{key}={given}: {message}"


def _two_source_blend(tmp_path, schedule):
    """data's blend keys over two empty datasets a and b in tmp_path, with blend_schedule `schedule`."""
    from types import SimpleNamespace

    for name in ("a", "b"):
        for suffix in (".bin", ".idx"):
            (tmp_path / f"{name}{suffix}").write_bytes(b"")
    return SimpleNamespace(path=None, blend=[1.0, str(tmp_path / "a"), 1.0, str(tmp_path / "b")], valid_blend=None,
                           blend_schedule=schedule)


@pytest.mark.parametrize("schedule", [[[5, 1]], [[5, "0.5"]], [[5, [0.5, 0.5], 3]], ["x"]])
def test_a_blend_schedule_entry_of_the_wrong_shape_names_the_form(tmp_path, schedule):
    """[[5,1]] (a bare number where the weights go) was a TypeError's traceback."""
    from megaframe.config.validate import check_blend

    d = _two_source_blend(tmp_path, schedule)
    problem = check_blend(d)
    assert problem is not None and "must be [STEP, [2 weights]]" in problem and "\n" not in problem, problem


@pytest.mark.parametrize("schedule, fragment", [
    ([[2, [float("nan"), 0.5]]], "the weights at step 2 must be finite numbers >= 0"),
    ([[2, [float("inf"), 0.5]]], "the weights at step 2 must be finite numbers >= 0"),
    ([[2, [1.5e308, 0.5e308]]], "summing to a finite number"),
    ([[True, [0.5, 0.5]]], "must be [STEP, [2 weights]]"),
])
def test_a_blend_schedule_of_weights_no_blend_can_use_is_refused(tmp_path, schedule, fragment):
    """nan and inf weights, and true for a step, trained on a meaningless blend, exit 0; weights
    summing past the largest float trained on an equal split (hostile review). data.blend's own
    weights: the same sum."""
    from megaframe.config.validate import check_blend

    d = _two_source_blend(tmp_path, schedule)
    problem = check_blend(d)
    assert problem is not None and fragment in problem and "\n" not in problem, problem
    d.blend, d.blend_schedule = [1.5e308, str(tmp_path / "a"), 0.5e308, str(tmp_path / "b")], None
    assert check_blend(d) == "data.blend: the weights sum past the largest float; scale them down (only their " \
                             "ratios count)"
