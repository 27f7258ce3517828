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


CODE_HOOKS = {  # what a YAML file can ask Hydra and Python's logging to run, and the key the refusal names
    "callback": ("hydra:\n  callbacks:\n    pwn:\n      _target_: shutil.copyfile\n"
                 "      _args_: [MARKER_SRC, MARKER]\n", "hydra.callbacks.pwn: Hydra would call the function"),
    "factory": ("hydra:\n  job_logging:\n    handlers:\n      pwn:\n        \"()\": shutil.copyfile\n"
                "        src: MARKER_SRC\n        dst: MARKER\n", "hydra.job_logging.handlers.pwn.()=shutil.copyfile"),
    "class": ("hydra:\n  hydra_logging:\n    handlers:\n      pwn:\n        class: own_module.Handler\n",
              "hydra.hydra_logging.handlers.pwn.class=own_module.Handler"),
    "ext": ("hydra:\n  job_logging:\n    handlers:\n      console:\n        stream: ext://os.system\n",
            "hydra.job_logging.handlers.console.stream=ext://os.system"),
    "file": ("hydra:\n  job_logging:\n    handlers:\n      f:\n        class: logging.FileHandler\n"
             "        filename: MARKER_SRC\n        mode: w\n", "hydra.job_logging.handlers.f.filename="),
    "socket": ("hydra:\n  job_logging:\n    handlers:\n      s:\n        class: logging.handlers.SocketHandler\n"
               "        host: example.org\n        port: 9\n", "hydra.job_logging.handlers.s.class=logging.handlers."),
    "plugin": ("hydra:\n  job:\n    env_set:\n      NCCL_NET_PLUGIN: /tmp/x.so\n",
               "hydra.job.env_set.NCCL_NET_PLUGIN: it makes"),
    "preload": ("hydra:\n  job:\n    env_set:\n      LD_PRELOAD: /tmp/x.so\n",
                "hydra.job.env_set.LD_PRELOAD: it makes"),
}


@pytest.mark.parametrize("hook", sorted(CODE_HOOKS))
def test_a_config_file_that_names_code_for_hydra_to_run_is_refused_before_it_runs(own, tmp_path, hook):
    """A --config-dir file's hydra.callbacks ran shutil.copyfile (the run then trained and exited 0), and
    a logging factory os.system; Hydra's blocklist stops a few names, and says it is no boundary."""
    text, message = CODE_HOOKS[hook]
    (tmp_path / "src").write_text("copied")
    marker = tmp_path / "code-ran"
    text = text.replace("MARKER_SRC", str(tmp_path / "src")).replace("MARKER", str(marker))
    (own / "model" / "hook.yaml").write_text("# @package _global_\n" + text)
    with pytest.raises(ConfigError) as refused:
        compose(config_dirs_as_searchpath(["--config-dir", str(own), "model=hook"]))
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)
    assert "megaframe runs no code from a config" in str(refused.value) and not marker.exists()
    assert (tmp_path / "src").read_text() == "copied"  # a log file named outside the run: not truncated


@pytest.mark.parametrize("kind, target, says", [
    ("sweeper", "os.system", "not a Hydra sweeper installed here"),
    ("launcher", "own_module.Launcher", "not a Hydra launcher installed here"),
    ("launcher", "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "not a Hydra launcher installed here"),
    ("sweeper", "${oc.env:NOPE}", "a plugin is named by its class, not an interpolation")])
def test_a_sweeps_plugin_hydra_has_not_registered_is_one_line_naming_the_key(own, kind, target, says):
    """Hydra refuses to build such a class, or to resolve such an interpolation, but in a traceback
    (review): an override and a file alike. A single run builds no sweeper or launcher, so it trains
    whatever a shared recipe pins there (review)."""
    from megaframe.config.compose import compose_for_run, hydra_plugin_problem
    from megaframe.launch.sweep import check_sweep_point

    (own / "model" / "plugin.yaml").write_text(f"# @package _global_\nhydra:\n  {kind}:\n    _target_: '{target}'\n")
    for args in ([f"hydra.{kind}._target_='{target}'"], ["--config-dir", str(own), "model=plugin"]):
        args = config_dirs_as_searchpath(args)
        problem = hydra_plugin_problem(compose_for_run(args)[2].hydra)
        assert problem == (f"hydra.{kind}._target_={target}: {says}; choose one by its option, hydra/{kind}=NAME "
                           f"(hydra/{kind}={'basic' if kind == 'sweeper' else 'megaframe_local'}, or an installed "
                           f"plugin's option)"), problem
        compose(args)  # a single run
    with pytest.raises(ConfigError, match=f"^hydra.{kind}._target_="):
        check_sweep_point(config_dirs_as_searchpath(["--config-dir", str(own), "model=plugin"]))
    assert hydra_plugin_problem(compose_for_run(["hydra/sweeper=basic", "hydra/launcher=megaframe_local"])[2].hydra) \
        is None


def test_a_logging_config_of_loggings_own_sinks_and_the_common_plugins_is_the_users_to_set(own):
    """Logging's own stream and null handlers, a file under the run directory, rich's handler and
    colorlog's formatter (review: they were refused), and Hydra's own options."""
    (own / "model" / "quiet.yaml").write_text(
        "# @package _global_\nhydra:\n  job_logging:\n    formatters:\n      colored:\n"
        "        \"()\": colorlog.ColoredFormatter\n    handlers:\n      console:\n"
        "        class: logging.StreamHandler\n        stream: ext://sys.stderr\n      rich:\n"
        "        class: rich.logging.RichHandler\n      file:\n        class: logging.handlers.RotatingFileHandler\n"
        "        filename: ${hydra.runtime.output_dir}/train.log\n  job:\n    env_set:\n      NCCL_DEBUG: WARN\n")
    compose(config_dirs_as_searchpath(["--config-dir", str(own), "model=quiet"]))
    for option in ("disabled", "none", "stdout", "default"):
        compose([f"hydra/job_logging={option}"])
    compose(["hydra/hydra_logging=disabled"])


def test_a_config_file_that_would_compose_for_minutes_is_refused_at_once(own):
    """279 bytes of YAML aliases nested five deep (a million values) composed for more than 90 s, and
    a 200 MB file printed nothing for two minutes (hostile review): refused before Hydra reads them."""
    import time

    lines = ["arch: gpt2", "x: &a [" + ",".join(["1"] * 10) + "]"]
    for level in range(5):
        lines.append(f"y{level}: &b{level} [" + ",".join([f"*{'a' if level == 0 else f'b{level - 1}'}"] * 10) + "]")
    (own / "model" / "bomb.yaml").write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"bomb.yaml: its YAML aliases expand to more than 100,000 values"):
        compose(config_dirs_as_searchpath(["--config-dir", str(own), "model=mine"]))
    assert time.monotonic() - started < 5
    (own / "model" / "bomb.yaml").unlink()
    (own / "model" / "huge.yaml").write_text("a: 1\n" * 300_000)
    with pytest.raises(ConfigError, match=r"huge.yaml: 1.4 MiB, more than a config file holds \(at most 1 MiB\)"):
        compose(config_dirs_as_searchpath(["--config-dir", str(own), "model=mine"]))
    (own / "model" / "huge.yaml").unlink()
    (own / "template.yaml").write_text("key: {{ jinja }}\n  bad: [\n")  # not YAML, and not used: Hydra's to name
    (own / "a" / "b" / "c").mkdir(parents=True)
    (own / "a" / "b" / "c" / "deep.yaml").write_text("a: 1\n" * 300_000)  # deeper than Hydra's options lie
    (own / "model" / "anchored.yaml").write_text("defaults:\n  - gpt_tiny\n  - _self_\nnum_layers: &n 3\n")
    assert compose(config_dirs_as_searchpath(["--config-dir", str(own), "model=anchored"]))[0].model.num_layers == 3


def test_a_config_files_unknown_key_is_named_with_its_file_and_the_keys_there(own):
    """It was OmegaConf's text: "In 'model/typo': ConfigKeyError raised while composing config: Key
    'num_layerz' not in 'ModelConfig' full_key: model.num_layerz reference_type=..." (hostile review)."""
    (own / "model" / "typo.yaml").write_text("defaults:\n  - gpt_tiny\n  - _self_\nnum_layerz: 3\n")
    with pytest.raises(ConfigError) as refused:
        compose(config_dirs_as_searchpath(["--config-dir", str(own), "model=typo"]))
    assert str(refused.value).startswith("model/typo.yaml: unknown key 'model.num_layerz'; known keys there: arch, "
                                         "num_layers,")


@pytest.mark.parametrize("override, message", [
    ("launcher.partition=gpu;rm", "launcher.partition=gpu;rm: Hydra's override grammar cannot read it "
                                  "(LexerNoViableAltException: launcher.partition=gpu;rm); quote a value with ; = , or "
                                  "spaces in it, the override in double quotes for the shell: "
                                  "\"launcher.partition='VALUE'\" (a list: \"launcher.partition=['VALUE']\")"),
    ("launcher.sbatch_extra=--qos=high", "launcher.sbatch_extra=--qos=high: Hydra's override grammar cannot read it "
                                         "(mismatched input '=' expecting <EOF>); quote a value with ; = , or spaces "
                                         "in it, the override in double quotes for the shell: "
                                         "\"launcher.sbatch_extra='VALUE'\" (a list: "
                                         "\"launcher.sbatch_extra=['VALUE']\")"),
    ("train.keep_checkpoints=null", "train.keep_checkpoints: field 'train.keep_checkpoints' is not Optional; give "
                                    "train.keep_checkpoints a value (null is not one it takes)"),
    ("data.blend=data/code", "data.blend: Invalid value assigned: str is not a ListConfig, list or tuple; write a "
                             "list in brackets, the override in double quotes for the shell: \"data.blend=[...]\""),
    ("launcher.partition=[a,b]", "launcher.partition: Cannot convert 'list' to string: '['a', 'b']'; "
                                 "launcher.partition takes one string, not a list (quote a value with brackets in "
                                 "it: \"launcher.partition='VALUE'\")"),
    ("launcher.partition={a:1}", "launcher.partition: Cannot convert 'dict' to string: '{'a': 1}'; "
                                 "launcher.partition takes one string, not a mapping (quote a value with brackets "
                                 "in it: \"launcher.partition='VALUE'\")"),
])
def test_an_override_hydra_or_omegaconf_cannot_take_says_what_to_write(override, message):
    """The key was named, the fix not: a Megatron user's data.blend=PREFIX, a partition with a
    semicolon, null for a key that takes none (hostile review)."""
    with pytest.raises(ConfigError) as refused:
        compose([override])
    assert str(refused.value) == message


def test_an_override_with_a_line_break_is_still_one_line():
    """The grammar's line quoted the override as typed: a newline in a value made it two (CI)."""
    with pytest.raises(ConfigError) as refused:
        compose(["launcher.job_name=a\n#SBATCH --partition=x"])
    assert str(refused.value).startswith("launcher.job_name=a\\n#SBATCH --partition=x: Hydra's override grammar")
    assert "\n" not in str(refused.value)


def test_defaults_lists_that_include_one_another_are_one_line_saying_so(own):
    """It was "maximum recursion depth exceeded in comparison", naming neither the files nor the loop."""
    (own / "model" / "ping.yaml").write_text("defaults:\n  - pong\n")
    (own / "model" / "pong.yaml").write_text("defaults:\n  - ping\n")
    with pytest.raises(ConfigError, match="^the configs' defaults lists include one another in a loop"):
        compose(config_dirs_as_searchpath(["--config-dir", str(own), "model=ping"]))
