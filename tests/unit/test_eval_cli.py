"""megaframe-eval's output and its run-config overrides, without a model (tests/e2e/test_eval_cli.py
evaluates real checkpoints)."""
from __future__ import annotations

import json
import math

import pytest

import megaframe.eval_cli as eval_cli
from megaframe.config.validate import ConfigError
from megaframe.run_config import load_run_config


def test_json_output_is_strict_json_with_null_for_non_finite_figures(monkeypatch, capsys):
    """A diverged checkpoint's loss is inf or NaN: Python's json wrote Infinity and NaN, which no
    strict parser (jq, browsers, json.loads(parse_constant=...)) reads."""
    result = {"checkpoint": "c", "config": None, "data": "d", "samples": 8, "tokens_per_sample": 32,
              "loss": float("nan"), "perplexity": float("inf"), "bits_per_byte": float("nan")}
    monkeypatch.setattr(eval_cli, "evaluate", lambda checkpoint, overrides: result)
    eval_cli.main(["ckpt", "--json"])
    line = capsys.readouterr().out

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    got = json.loads(line, parse_constant=refuse)
    assert got["loss"] is None and got["perplexity"] is None and got["bits_per_byte"] is None and got["samples"] == 8
    result.update(loss=math.log(2) * 3, perplexity=8.0, bits_per_byte=3.0)
    eval_cli.main(["ckpt"])
    assert capsys.readouterr().out == ("megaframe-eval: c on d: loss 2.0794, perplexity 8.00, 3.0000 bits per byte "
                                       "over 8 samples of 32 tokens\n")


def test_overrides_change_single_keys_of_the_runs_config_or_pick_a_data_option(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("data:\n  path: data/train\n  valid_path: data/val\n  tokenizer: byte\n"
                      "train:\n  eval_steps: 20\nparallel:\n  micro_batch_size: 12\n  global_batch_size: 12\n")
    cfg = load_run_config(config)
    assert (cfg.data.path, cfg.data.valid_path, cfg.train.eval_steps, cfg.parallel.global_batch_size) == \
        ("data/train", "data/val", 20, 12)
    cfg = load_run_config(config, ["data.valid_path=data/other", "train.eval_steps=3"])
    assert (cfg.data.path, cfg.data.valid_path, cfg.train.eval_steps) == ("data/train", "data/other", 3)
    cfg = load_run_config(config, ["data=demo"])  # the whole section replaced by conf/data/demo.yaml
    assert cfg.data.path is None and cfg.data.valid_path is None
    assert eval_cli.describe_data(cfg.data) == "held-out 0.05 of the demo corpus"
    for bad, message in ((["data.vaild_path=x"], "unknown key 'data.vaild_path'"),
                         (["~data.path"], "~data.path: give KEY=VALUE, or data=OPTION")):
        with pytest.raises(ConfigError, match=message):
            load_run_config(config, bad)
    config.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not a readable run config"):
        load_run_config(config)
    config.write_text("data:\n  no_such_key: 1\n")
    with pytest.raises(ConfigError, match="does not fit this megaframe's config schema"):
        load_run_config(config)
    config.unlink()
    with pytest.raises(ConfigError, match="the run's config is missing"):
        load_run_config(config)


def test_the_runs_relative_data_paths_are_read_from_the_directory_it_was_started_in(tmp_path, monkeypatch):
    """megaframe-eval RUN/checkpoints from another directory: data/train is the run's, relative to
    where it trained (Hydra's hydra.runtime.cwd), not to wherever the command is started."""
    run_dir, started = tmp_path / "run", tmp_path / "project"
    (run_dir / ".hydra").mkdir(parents=True)
    started.mkdir()
    (run_dir / "config.yaml").write_text("data:\n  path: data/train\n  valid_path: /abs/val\n"
                                         "  blend: [0.3, data/a, '0.7', data/b]\n  tokenizer: byte\n")
    (run_dir / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {started}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(run_dir / "config.yaml", ["data.valid_path=mine"])  # an override is the user's, as given
    assert (cfg.data.path, cfg.data.valid_path) == (str(started / "data/train"), "mine")
    assert cfg.data.blend == [0.3, str(started / "data/a"), "0.7", str(started / "data/b")] and cfg.data.tokenizer == "byte"
    monkeypatch.chdir(started)  # where the run started: the paths as the run wrote them
    assert load_run_config(run_dir / "config.yaml").data.path == "data/train"
    (run_dir / ".hydra" / "hydra.yaml").unlink()  # not recorded: as written, read from here
    monkeypatch.chdir(tmp_path)
    assert load_run_config(run_dir / "config.yaml").data.path == "data/train"
