"""--config-dir DIR as the override it stands for (hydra.searchpath), so that a user's own options
take the ordinary way through megaframe-train (pre-launch checks, rank launch) and megaframe-plan."""
from __future__ import annotations

import pytest

from megaframe.config.compose import compose, config_dirs_as_searchpath
from megaframe.config.validate import ConfigError

OWN_MODEL = "arch: gpt2\nnum_layers: 3\nhidden_size: 48\nnum_attention_heads: 4\nseq_length: 40\n"


@pytest.fixture
def own(tmp_path):
    (tmp_path / "own" / "model").mkdir(parents=True)
    (tmp_path / "own" / "model" / "mine.yaml").write_text(OWN_MODEL)
    return tmp_path / "own"


@pytest.mark.parametrize("form", ["--config-dir {}", "-cd {}", "--config-dir={}"])
def test_each_spelling_composes_the_directorys_options(own, form):
    args = config_dirs_as_searchpath(["model=mine", *form.format(own).split(" "), "train.max_steps=3"])
    assert args[1:] == ["model=mine", "train.max_steps=3"] and args[0].startswith("hydra.searchpath=")
    cfg, _ = compose(args)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length) == (3, 48, 40)


def test_without_the_flag_the_overrides_are_unchanged_and_the_option_unknown(own):
    args = ["model=mine"]
    assert config_dirs_as_searchpath(args) == args
    with pytest.raises(ConfigError, match="model=mine: no such option"):
        compose(args)


def test_several_directories_are_searched_in_the_order_given(own, tmp_path):
    (tmp_path / "second" / "model").mkdir(parents=True)
    (tmp_path / "second" / "model" / "mine.yaml").write_text(OWN_MODEL.replace("num_layers: 3", "num_layers: 5"))
    (tmp_path / "second" / "model" / "other.yaml").write_text(OWN_MODEL.replace("num_layers: 3", "num_layers: 7"))
    first = compose(config_dirs_as_searchpath(["-cd", str(own), "-cd", str(tmp_path / "second"), "model=mine"]))[0]
    other = compose(config_dirs_as_searchpath(["-cd", str(own), "-cd", str(tmp_path / "second"), "model=other"]))[0]
    assert (first.model.num_layers, other.model.num_layers) == (3, 7)


def test_a_relative_directory_is_made_absolute(own, monkeypatch):
    monkeypatch.chdir(own.parent)
    args = config_dirs_as_searchpath(["--config-dir", "own", "model=mine"])
    assert args[0] == f"hydra.searchpath=['file://{own.resolve()}']"


def test_the_override_goes_before_the_first_override_where_hydras_flags_may_follow(own):
    """Hydra's parser takes the overrides as one run of words: an override after `--cfg job` or a
    trailing `-m` is an 'unrecognized argument'."""
    path = f"hydra.searchpath=['file://{own.resolve()}']"
    assert config_dirs_as_searchpath(["--cfg", "job", "-cd", str(own), "model=mine"]) == ["--cfg", "job", path, "model=mine"]
    assert config_dirs_as_searchpath(["-cd", str(own), "model=mine", "-m"]) == [path, "model=mine", "-m"]
    assert config_dirs_as_searchpath(["-cd", str(own)]) == [path]


@pytest.mark.parametrize("flag", ["--help", "-h", "--info"])
def test_a_help_keeps_the_flag_which_hydra_lists_the_options_of(own, flag):
    args = ["--config-dir", str(own), "model=mine", flag]
    assert config_dirs_as_searchpath(args) == args


@pytest.mark.parametrize("args, message", [
    (["model=mine", "--config-dir"], "--config-dir needs a directory: --config-dir DIR"),
    (["model=mine", "--config-dir="], "--config-dir needs a directory: --config-dir DIR"),
    (["-cd", "/no/such/dir", "model=mine"], "-cd /no/such/dir: no such directory"),
    (["-cd", "OWN", "hydra.searchpath=[file:///tmp]"], "hydra.searchpath and --config-dir both given"),
])
def test_bad_config_dirs_are_one_line_naming_the_flag(own, args, message):
    with pytest.raises(ConfigError, match=message) as err:
        config_dirs_as_searchpath([str(own) if a == "OWN" else a for a in args])
    assert "\n" not in str(err.value)
