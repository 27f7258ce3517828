"""megaframe-eval's output and its run-config overrides, without a model (tests/e2e/test_eval_cli.py
evaluates real checkpoints)."""
from __future__ import annotations

import json
import math

import pytest

import megaframe.eval_cli as eval_cli
from megaframe.config.validate import ConfigError
from megaframe.run_config import IncompleteRunConfig, load_run_config


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


def test_perplexity_is_nan_for_a_nan_loss_and_inf_past_exps_range():
    assert math.isnan(eval_cli.perplexity(float("nan")))
    assert eval_cli.perplexity(800.0) == eval_cli.perplexity(float("inf")) == float("inf")
    assert eval_cli.perplexity(math.log(8.0)) == pytest.approx(8.0)


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
                         (["~data.path"], "~data.path: give KEY=VALUE, or data=OPTION"),
                         # a value of the wrong type is the override's, not the file's ("config.yaml: does
                         # not fit this megaframe's config schema", which sent the user to a good file)
                         (["train.eval_steps=abc"], "^train.eval_steps=abc: Value 'abc' of type 'str' could not be "
                                                    "converted to Integer$")):
        with pytest.raises(ConfigError, match=message):
            load_run_config(config, bad)
    config.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not a readable run config"):
        load_run_config(config)
    config.write_text("data:\n  path: null\n  tokenizer: byte\n  no_such_key: 1\n")
    with pytest.raises(ConfigError, match="does not fit this megaframe's config schema"):
        load_run_config(config)
    # the file's own bad value, with a good override: the file is named
    config.write_text("data:\n  path: null\n  tokenizer: byte\ntrain:\n  eval_steps: twenty\n")
    with pytest.raises(ConfigError, match=f"^{config}: does not fit this megaframe's config schema"):
        load_run_config(config, ["data.tokenizer=byte"])
    # an empty or cut file is not the run's: its gaps were the defaults (the demo corpus scored, review)
    for cut in ("", "data:\n  valid_fraction: 0.5\n"):
        config.write_text(cut)
        with pytest.raises(IncompleteRunConfig, match=f"^{config}: not the whole config megaframe-train wrote "
                                                      f"\\(data.path is missing\\), so the data the run trained on "
                                                      f"is unknown; put the run's config.yaml back, or name the data"):
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


class _Stop(Exception):
    """Raised where the model would load: the test is about the config chosen before that."""


def _scored_config(monkeypatch, checkpoint, overrides=()):
    """The (config, config file) megaframe-eval picks for `checkpoint`; the model is never loaded."""
    chosen = []
    real = eval_cli._eval_config

    def record(path, given, *tokenizer):
        chosen.append(real(path, given, *tokenizer))
        return chosen[-1]

    def stop(*_):
        raise _Stop
    monkeypatch.setattr(eval_cli, "_eval_config", record)
    monkeypatch.setattr("megaframe.load.load_model", stop)
    with pytest.raises(_Stop):
        eval_cli.evaluate(checkpoint, list(overrides))
    return chosen[-1]


def _fake_checkpoint(directory):
    """The files resolve_checkpoint looks for (a layout-free checkpoint's), empty: never loaded."""
    directory.mkdir(parents=True)
    (directory / "state.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")


def test_a_linked_checkpoints_directory_is_scored_with_its_own_runs_config(tmp_path, monkeypatch):
    """RUN/checkpoints linked to /shared/proj/checkpoints: resolving `latest` follows the link, and
    the config beside its target (/shared/proj/config.yaml) is another run's: its data were scored
    in silence. The run is the one the user named, also as `.` from inside the linked directory."""
    shared, run = tmp_path / "shared" / "proj", tmp_path / "run"
    _fake_checkpoint(shared / "checkpoints" / "global_step5")
    (shared / "checkpoints" / "latest").write_text("global_step5\n")
    # another run's:
    (shared / "config.yaml").write_text("data:\n  path: null\n  tokenizer: byte\ntrain:\n  eval_steps: 9\n")
    run.mkdir()
    (run / "checkpoints").symlink_to(shared / "checkpoints")
    (run / "config.yaml").write_text("data:\n  path: null\n  tokenizer: byte\ntrain:\n  eval_steps: 3\n")
    cfg, config_file = _scored_config(monkeypatch, run / "checkpoints")
    assert (config_file, cfg.train.eval_steps) == (run / "config.yaml", 3)
    (run / "config.yaml").write_text("")  # cut to nothing: only data the user names is scored, as with none
    cfg, config_file = _scored_config(monkeypatch, run / "checkpoints", ["data=demo", "train.eval_steps=2"])
    assert (config_file, cfg.train.eval_steps, eval_cli.describe_data(cfg.data)) == (
        None, 2, "held-out 0.05 of the demo corpus")
    (run / "config.yaml").write_text("data:\n  path: null\n  tokenizer: byte\ntrain:\n  eval_steps: 3\n")
    cfg, config_file = _scored_config(monkeypatch, run / "checkpoints" / "global_step5")
    assert (config_file, cfg.train.eval_steps) == (run / "config.yaml", 3)
    monkeypatch.chdir(run / "checkpoints")
    monkeypatch.setenv("PWD", str(run / "checkpoints"))  # the shell's logical directory
    cfg, config_file = _scored_config(monkeypatch, eval_cli.Path("."))
    assert (config_file, cfg.train.eval_steps) == (run / "config.yaml", 3)


def test_empty_data_overrides_are_refused_not_scored_as_other_data(tmp_path, monkeypatch, capsys):
    """`data.blend=[]` read as "no blend" and scored the demo corpus; `data.valid_path=` a slice of
    the training data: one line naming the key, exit 2, before the model loads."""
    run = tmp_path / "run"
    _fake_checkpoint(run / "checkpoints" / "global_step5")
    (run / "checkpoints" / "latest").write_text("global_step5\n")
    for prefix in ("a", "b"):
        (tmp_path / f"{prefix}.bin").write_bytes(b"")
        (tmp_path / f"{prefix}.idx").write_bytes(b"")
    (run / "config.yaml").write_text(f"data:\n  path: null\n  tokenizer: byte\n  valid_path: null\n"
                                     f"  blend: [0.5, {tmp_path}/a, 0.5, {tmp_path}/b]\n")  # as a run saves it
    monkeypatch.setattr("megaframe.load.load_model", lambda *_: pytest.fail("the model loaded"))
    for override, key in (("data.blend=[]", "data.blend=[] is empty"), ("data.valid_path=", "data.valid_path=''"),
                          ("data.tokenizer=", "data.tokenizer=''")):
        with pytest.raises(SystemExit) as exit_info:
            eval_cli.main([str(run / "checkpoints"), override])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and key in err, (override, err)
    (run / "config.yaml").write_text("data:\n  tokenizer: byte\n  path: gone/train\n")  # the run's data moved
    with pytest.raises(SystemExit):
        eval_cli.main([str(run / "checkpoints")])
    err = capsys.readouterr().err
    assert f"the run's data ({run / 'config.yaml'})" in err and "gone/train" in err, err
    # a typo on the command line is the user's, not the run config's (it was blamed on config.yaml)
    with pytest.raises(SystemExit):
        eval_cli.main([str(run / "checkpoints"), "data.path=typo/train"])
    err = capsys.readouterr().err
    assert err.startswith("megaframe-eval: error: data.path=typo/train: ") and "config.yaml" not in err, err


def test_run_files_are_read_once_not_through_links_and_capped(tmp_path, monkeypatch):
    """config.yaml linked elsewhere was reported as "missing" (is_symlink, then OmegaConf.load: a
    race, no size cap), .hydra/hydra.yaml likewise; the plot read config.yaml a third way. Now one
    reader: a link is named as a link, a FIFO does not hang, a huge file is not read."""
    import os

    import megaframe.run_config as run_config
    from megaframe.tracking.plot import _seq_length

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("data:\n  tokenizer: byte\nmodel:\n  seq_length: 64\n")
    (run / "config.yaml").symlink_to(elsewhere)
    for read in (load_run_config, lambda path: _seq_length(path.parent)):
        with pytest.raises(ConfigError, match="config.yaml is a symbolic link, not a file megaframe wrote"):
            read(run / "config.yaml")
    (run / "config.yaml").unlink()
    os.mkfifo(run / "config.yaml")  # nobody writes it: reading it would wait forever
    with pytest.raises(ConfigError, match="config.yaml is a FIFO"):
        load_run_config(run / "config.yaml")
    _fake_checkpoint(run / "checkpoints" / "global_step5")  # megaframe-eval called it "missing" (review)
    with pytest.raises(ConfigError, match="config.yaml is a FIFO"):
        _scored_config(monkeypatch, run / "checkpoints" / "global_step5")
    (run / "config.yaml").unlink()
    (run / "config.yaml").write_text("model:\n  seq_length: 32\n")
    assert _seq_length(run) == 32 and _seq_length(tmp_path) is None  # the plot: read, or no config at all
    monkeypatch.setattr(run_config, "CONFIG_CAP", 8)
    with pytest.raises(ConfigError, match="more than the 8"):
        load_run_config(run / "config.yaml")
    started = tmp_path / "started"
    started.mkdir()
    (tmp_path / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {started}\n")
    (run / ".hydra" / "hydra.yaml").symlink_to(tmp_path / "hydra.yaml")
    assert run_config.training_directory(run) is None  # a link megaframe did not make: not recorded
    (run / ".hydra" / "hydra.yaml").unlink()
    (run / ".hydra" / "hydra.yaml").write_text((tmp_path / "hydra.yaml").read_text())
    assert run_config.training_directory(run) == started


def _word_model_and_data(tmp_path):
    """A checkpoint trained with a word-level HF tokenizer (its copy and record inside), and
    tmp/words, a dataset made with that tokenizer: (the tokenizer's directory, the checkpoint)."""
    from megaframe.checkpoint import tokenizer_record as records
    from megaframe.data.preprocess import preprocess
    from megaframe.data.tokenizer import HFTokenizer
    from tests.unit.test_sample_cli import checkpoint, word_tokenizer

    tok = word_tokenizer(tmp_path / "tok")
    loaded = HFTokenizer(tok)
    ckpt = tmp_path / "ckpt"
    record = records.hf_record(tok, loaded.vocab_size, loaded.eod_id)
    checkpoint(ckpt, tokenizer_src=tok, **{records.RECORD_KEY: record})
    text = [" ".join(f"w{(d * 3 + i) % 11}" for i in range(40)) for d in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    preprocess([tmp_path / "docs.jsonl"], tmp_path / "words", tokenizer=str(tok), progress=False)
    return tok, ckpt


def test_the_data_is_scored_with_the_checkpoints_tokenizer_and_another_ones_tokens_are_one_line(tmp_path, capsys):
    """A model trained with a Hugging Face tokenizer: megaframe-eval takes the tokenizer from the
    checkpoint (its copy), so data made with it is scored without naming data.tokenizer; data made
    with another is one line saying to tokenize it with the checkpoint's; a data.tokenizer naming
    another is refused. It used to compare each dataset with the run config's data.tokenizer, and
    sent the user back and forth between two "set data.tokenizer=..." fixes (one for data it was not
    even scoring: data.path, beside data.valid_path)."""
    from megaframe.data.preprocess import preprocess

    tok, ckpt = _word_model_and_data(tmp_path)
    preprocess([tmp_path / "docs.jsonl"], tmp_path / "bytes", progress=False)
    batches = ["parallel.micro_batch_size=2", "parallel.global_batch_size=2", "train.eval_steps=2"]

    # scored with the checkpoint's copy, whatever data.path holds: only the validation file is opened
    result = eval_cli.evaluate(ckpt, [f"data.path={tmp_path / 'bytes'}", f"data.valid_path={tmp_path / 'words'}",
                                      *batches])
    assert math.isfinite(result["loss"]) and result["data"] == f"data.valid_path={tmp_path / 'words'}"
    assert result["loss"] == eval_cli.evaluate(ckpt, [f"data.path={tmp_path / 'words'}", f"data.tokenizer={tok}",
                                                      f"data.valid_path={tmp_path / 'words'}", *batches])["loss"]

    def refusal(*overrides: str) -> str:
        with pytest.raises(SystemExit) as done:
            eval_cli.main([str(ckpt), *overrides, *batches])
        err = capsys.readouterr().err
        assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err.strip()

    assert refusal(f"data.path={tmp_path / 'words'}", f"data.valid_path={tmp_path / 'bytes'}") == (
        f"megaframe-eval: error: {tmp_path / 'bytes'}: its tokens were made by byte ({tmp_path / 'bytes'}.json), but "
        f"the checkpoint's model reads {ckpt / 'tokenizer'}'s: tokenize its text with megaframe-preprocess "
        f"--tokenizer {ckpt / 'tokenizer'}")
    assert refusal(f"data.path={tmp_path / 'bytes'}", "data.tokenizer=byte").startswith(
        "megaframe-eval: error: data.tokenizer=byte: the checkpoint's model was trained with ")
    # -16 "must be a multiple of" -8, which it is; a path as a data option read as "data/../..=etc" (review)
    with pytest.raises(SystemExit) as done:  # refusal() appends the good batch sizes
        eval_cli.main([str(ckpt), f"data.path={tmp_path / 'words'}", "parallel.micro_batch_size=-8",
                       "parallel.global_batch_size=-16"])
    assert (done.value.code, capsys.readouterr().err) == (2, "megaframe-eval: error: parallel.micro_batch_size=-8 and "
                                                             "parallel.global_batch_size=-16 must be >= 1\n")
    assert refusal("data=../../etc") == "megaframe-eval: error: data=../../etc: no such option; available: demo"
    with pytest.raises(SystemExit) as done:  # argparse's two-line usage block (review)
        eval_cli.main(["--bogus"])
    assert (done.value.code, capsys.readouterr().err) == (2, "megaframe-eval: error: the following arguments are "
                                                             "required: checkpoint, overrides (see megaframe-eval "
                                                             "--help)\n")

    # the run's own config naming a tokenizer directory and a training set that are both gone: its
    # checkpoint's copy serves, and data.valid_path is scored alone (both were refused, blaming config.yaml)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (ckpt).rename(run / "checkpoints" / "global_step1")
    (run / "checkpoints" / "latest").write_text("global_step1\n")
    (run / "config.yaml").write_text(f"data:\n  tokenizer: {tmp_path / 'gone-tok'}\n  path: {tmp_path / 'gone'}\n"
                                     "  valid_path: null\ntrain:\n  eval_steps: 2\nparallel:\n  micro_batch_size: 2\n"
                                     "  global_batch_size: 2\n")  # as a run saves them: every key overridden below
    result = eval_cli.evaluate(run / "checkpoints", [f"data.valid_path={tmp_path / 'words'}"])
    assert math.isfinite(result["loss"]) and result["config"] == str(run / "config.yaml")


def test_an_evaluation_asked_beyond_the_validation_set_is_refused_and_the_runs_own_is_warned(tmp_path, capsys):
    """train.eval_steps=100000000 on the command line warned, then ran on for good (found by review);
    a run's own setting is evaluated as the run evaluated it, with its warning."""
    tok, ckpt = _word_model_and_data(tmp_path)
    data = [f"data.path={tmp_path / 'words'}", "parallel.micro_batch_size=2"]
    with pytest.raises(SystemExit) as done:
        eval_cli.main([str(ckpt), *data, "parallel.global_batch_size=2", "train.eval_steps=100000000"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("megaframe-eval: error: train.eval_steps=100000000 evaluates 100000000 x 2 = 200000000 "
                          "samples but the validation set holds "), err
    assert "; set train.eval_steps<=" in err, err
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt.rename(run / "checkpoints" / "global_step1")
    (run / "checkpoints" / "latest").write_text("global_step1\n")
    (run / "config.yaml").write_text(f"data:\n  tokenizer: {tok}\n  path: {tmp_path / 'words'}\n"
                                     "train:\n  eval_steps: 400\nparallel:\n  micro_batch_size: 2\n"
                                     "  global_batch_size: 2\n")
    result = eval_cli.evaluate(run / "checkpoints", [])  # the run's own 400 x 2: warned, and evaluated
    assert math.isfinite(result["loss"]) and result["samples"] == 800
    assert "megaframe-eval: warning: train.eval_steps=400 evaluates 400 x 2 = 800 samples" in capsys.readouterr().err
