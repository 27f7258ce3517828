"""Pre-launch refusals of the attention masks' keys (config/attention_rules.py): one line naming the
key, exit 2 from megaframe-train, nothing written."""
from __future__ import annotations

import json

import pytest
import torch

from megaframe.config.attention_rules import core_problem, layout_problem
from megaframe.config.schema import TrainConfig
from megaframe.config.validate import ConfigError, validate
from megaframe.launch.main import train_main
from megaframe.plan.cli import main as plan_main
from megaframe.model.attention import FlexCore, Mask, RingCore, UlyssesCore
from megaframe.parallel.context import ContextGroup


def _cfg(**sections) -> TrainConfig:
    cfg = TrainConfig()
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.mark.parametrize("changes, world, message", [
    ({"model__sliding_window": 0}, 1, "model.sliding_window=0 must be a whole number >= 1"),
    ({"model__sliding_window": -4}, 1, "model.sliding_window=-4 must be a whole number >= 1"),
    ({"model__window_attn_skip_freq": 2}, 1, "model.window_attn_skip_freq=2 says which layers skip"),
    ({"model__sliding_window": 8, "model__window_attn_skip_freq": 0}, 1, "model.window_attn_skip_freq=0 must be >= 1"),
    ({"model__sliding_window": 8, "model__window_attn_skip_freq": [1, 2]}, 1, "model.window_attn_skip_freq=[1, 2] must"),
    ({"model__sliding_window": 8, "model__num_layers": 2, "model__window_attn_skip_freq": [1, 1, 0]}, 1,
     "model.window_attn_skip_freq lists 3 layers but model.num_layers=2"),
    # a window no layer takes trained full attention, exit 0, as if the window were there (review)
    ({"model__sliding_window": 16, "model__window_attn_skip_freq": 1}, 1,
     "model.window_attn_skip_freq=1 makes every layer global: model.sliding_window=16 is unused"),
    ({"model__sliding_window": 16, "model__window_attn_skip_freq": [0, 0]}, 1,
     "model.window_attn_skip_freq=[0, 0] makes every layer global"),
    ({"model__sliding_window": 8, "parallel__pp": 2, "parallel__cp": 2, "parallel__cp_impl": "ulysses"}, 4,
     "model.sliding_window=8 with parallel.cp_impl=ulysses and parallel.cp=2: Ulysses builds the mask dense"),
    ({"data__document_mask": True, "parallel__cp": 2, "parallel__cp_impl": "ulysses"}, 2,
     "data.document_mask=true with parallel.cp_impl=ulysses and parallel.cp=2: Ulysses builds the mask dense"),
    ({"model__sliding_window": 8, "parallel__cp": 2, "parallel__cp_impl": "ulysses"}, 2,
     "model.sliding_window=8 with parallel.cp_impl=ulysses and parallel.cp=2: Ulysses builds the mask dense"),
    ({"model__sliding_window": 8, "data__document_mask": True, "parallel__cp": 2, "parallel__cp_impl": "ulysses"}, 2,
     "data.document_mask=true with parallel.cp_impl=ulysses"),
    ({"model__attention_core": "fast"}, 1, "model.attention_core='fast' is not one of ['auto', 'sdpa', 'flex']"),
    ({"model__attention_core": "flex", "model__dropout": 0.1}, 1,
     "model.attention_core=flex with model.dropout=0.1: FlexAttention has no attention dropout"),
    ({"model__attention_core": "flex", "parallel__cp": 2}, 2,
     "model.attention_core=flex with parallel.cp=2: context parallelism attends through parallel.cp_impl=ring"),
])
def test_bad_mask_settings_are_refused_naming_the_key(changes, world, message):
    with pytest.raises(ConfigError) as refused:
        validate(_cfg(**changes), world)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)


def test_good_mask_settings_pass():
    validate(_cfg(model__sliding_window=8, model__window_attn_skip_freq=[1, 0]), 1)
    validate(_cfg(model__sliding_window=8, parallel__pp=2, parallel__tp=2), 4)  # windows need no token ids
    validate(_cfg(data__document_mask=True, data__eod_mask_loss=True), 2)  # dp=2
    validate(_cfg(data__document_mask=True, parallel__tp=2, parallel__sequence_parallel=True), 2)
    # pipeline stages of either engine find the documents in the token ids (docs/attention.md)
    validate(_cfg(data__document_mask=True, data__eod_mask_loss=True, parallel__pp=2), 2)
    validate(_cfg(data__document_mask=True, model__sliding_window=4, parallel__pp=2, parallel__tp=2,
                  parallel__sequence_parallel=True), 4)
    validate(_cfg(data__document_mask=True, parallel__cp=2), 2)  # the cp cores apply both masks
    # pipeline stages over cp shards: each stage gathers the rows' token ids over cp (docs/attention.md)
    validate(_cfg(data__document_mask=True, data__eod_mask_loss=True, model__sliding_window=8, parallel__pp=2,
                  parallel__cp=2), 4)
    validate(_cfg(model__sliding_window=8, data__document_mask=True, parallel__cp=2, parallel__cp_impl="ring"), 2)
    # Ulysses takes plain causal attention, a window no shorter than the sequence (no window), and
    # data.eod_mask_loss (the loss's mask, not attention's)
    for ok in ({}, {"model__sliding_window": 128, "model__seq_length": 128}, {"data__eod_mask_loss": True}):
        validate(_cfg(parallel__cp=2, parallel__cp_impl="ulysses", **ok), 2)


def test_the_cp_rule_says_what_the_cores_support():
    """The rule mirrors RingCore.supports (config may not import it): each mask the rule refuses
    under the ring, the core cannot apply, and the plain causal one both cores take (today the ring
    rule refuses none and the cores take every causal mask; a non-causal one no key makes). Ulysses
    applies both masks too, but is refused them for memory: its mask is dense over the sequence."""
    one = ContextGroup(group=None, ranks=(0,), rank=0)
    masks = {"document_mask": Mask(documents=torch.zeros(1, 4, dtype=torch.long)), "sliding_window": Mask(window=4)}
    for impl, core in (("ring", RingCore(0.0, None, one)), ("ulysses", UlyssesCore(0.0, None, one))):
        for key, mask in masks.items():
            cfg = _cfg(parallel__cp=2, parallel__cp_impl=impl,
                       **({"data__document_mask": True} if key == "document_mask" else {"model__sliding_window": 4}))
            assert core.supports(mask), (impl, key)
            assert (layout_problem(cfg) is not None) == (impl == "ulysses"), (impl, key)
        assert layout_problem(_cfg(parallel__cp=2, parallel__cp_impl=impl)) is None and core.supports(Mask())
        assert not core.supports(Mask(causal=False))


def test_the_core_rule_says_what_flex_supports():
    """model.attention_core=flex is refused with a mask key exactly when FlexCore cannot apply that
    mask (today it applies every Mask, non-causal too); sdpa and auto pass with every mask key."""
    masks = {"data__document_mask": Mask(documents=torch.zeros(1, 4, dtype=torch.long)),
             "model__sliding_window": Mask(window=4)}
    values = {"data__document_mask": True, "model__sliding_window": 4}
    for key, mask in masks.items():
        for core in ("auto", "sdpa"):
            assert core_problem(_cfg(model__attention_core=core, **{key: values[key]})) is None
        refused = core_problem(_cfg(model__attention_core="flex", **{key: values[key]})) is not None
        assert refused == (not FlexCore(0.0).supports(mask)), key
    assert FlexCore(0.0).supports(Mask(causal=False))


def test_flex_is_refused_where_this_host_trains_on_the_cpu():
    """validate's device answer (fp8_device: the GPU's capability, None on the CPU): flex has no CPU
    backward in torch; where the device is not asked (the planner) the rule waits."""
    cfg = _cfg(model__attention_core="flex")
    with pytest.raises(ConfigError, match=r"^model.attention_core=flex on the CPU: torch's FlexAttention has no back"):
        validate(cfg, 1, fp8_device=lambda: None)
    validate(cfg, 1, fp8_device=lambda: (9, 0))
    validate(cfg, 1)
    validate(_cfg(), 1, fp8_device=lambda: None)  # auto: sdpa on the CPU


def _dataset_without_eods(tmp_path) -> str:
    prefix = tmp_path / "noeod"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"noeod{suffix}").write_bytes(b"")
    (tmp_path / "noeod.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256,
                                                     "append_eod": False}))
    return str(prefix)


@pytest.mark.parametrize("override, key", [("model.sliding_window=0", "model.sliding_window=0"),
                                           ("data.document_mask=true", "data.document_mask=true needs"),
                                           ("model.attention_core=flex", "model.attention_core=flex on the CPU")])
def test_megaframe_train_refuses_before_launch(override, key, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        train_main([override, f"data.path={_dataset_without_eods(tmp_path)}", f"hydra.run.dir={run}",
                     "train.max_steps=1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megaframe-train: error: {key}"), lines[0]
    assert not run.exists()


@pytest.mark.parametrize("override, key", [("data.document_mask=true", "data.document_mask=true"),
                                           ("model.sliding_window=8", "model.sliding_window=8")])
def test_ulysses_with_a_mask_is_refused_before_launch_and_by_the_planner(override, key, tmp_path, capsys,
                                                                         monkeypatch):
    """Ulysses would build the mask dense over the whole sequence in every block (parallel/context.py's
    attention_allowed: 128 GiB of int64 at T=131072): one line from megaframe-train and megaframe-plan,
    exit 2, naming the key and the ring; the ring takes the same mask."""
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    line = f"{key} with parallel.cp_impl=ulysses and parallel.cp=2: "
    ulysses = [override, "parallel.cp=2", "parallel.cp_impl=ulysses"]
    with pytest.raises(SystemExit) as ended:
        train_main([*ulysses, f"hydra.run.dir={run}", "train.max_steps=1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megaframe-train: error: {line}") and "use parallel.cp_impl=ring" in lines[0], lines[0]
    assert not run.exists()
    with pytest.raises(SystemExit) as ended:
        plan_main(ulysses)
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"megaframe-plan: error: {line}"), lines
    plan_main([override, "parallel.cp=2", "parallel.cp_impl=ring"])  # the ring's plan
    assert "error" not in capsys.readouterr().err
