"""logging.wandb.mode=online without a key is one line before launch (wandb would prompt on rank 0's
terminal, or fail with its own traceback after the ranks started)."""
from __future__ import annotations

from megaframe.tracking.wandb_run import online_key_problem


def test_offline_and_disabled_need_no_key(tmp_path):
    assert online_key_problem("offline", {"NETRC": str(tmp_path / "none")}) is None
    assert online_key_problem("disabled", {"NETRC": str(tmp_path / "none")}) is None


def test_online_finds_the_key_where_wandb_does(tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc.chmod(0o600)
    assert online_key_problem("online", {"WANDB_API_KEY": "k", "NETRC": str(tmp_path / "none")}) is None
    assert online_key_problem("online", {"NETRC": str(netrc)}) is None
    # a self-hosted server's key is its host's entry, not api.wandb.ai's
    problem = online_key_problem("online", {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"})
    assert problem is not None and "wandb.example.org" in problem


def test_online_without_a_key_names_the_ways_to_give_one(tmp_path):
    problem = online_key_problem("online", {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "none")})
    assert problem is not None and "\n" not in problem
    assert "WANDB_API_KEY" in problem and "wandb login" in problem and "logging.wandb.mode=offline" in problem


def test_a_wandb_mode_in_the_environment_that_wandb_does_not_know_is_one_line():
    """wandb reads WANDB_MODE as it loads its settings: WANDB_MODE=weird ended rank 0 after launch
    with wandb's ValidationError (exit 1). What wandb accepts is read from its own Settings; with
    W&B disabled wandb never starts, and the variable is no one's business."""
    import typing

    from wandb.sdk.wandb_settings import Settings

    from megaframe.tracking.wandb_run import env_mode_problem

    accepted = typing.get_args(Settings.model_fields["mode"].annotation)
    assert accepted and all(env_mode_problem("offline", {"WANDB_MODE": mode}) is None for mode in accepted)
    assert env_mode_problem("offline", {}) is None
    assert env_mode_problem("disabled", {"WANDB_MODE": "weird"}) is None
    problem = env_mode_problem("offline", {"WANDB_MODE": "weird"})
    assert problem.startswith("WANDB_MODE='weird' (in the environment) is no W&B mode") and "\n" not in problem
    assert "unset it (logging.wandb.mode=offline chooses the mode)" in problem
    # logging.wandb.mode left null: the line named "logging.wandb.mode=offline", a setting the user never made
    problem = env_mode_problem("offline", {"WANDB_MODE": "weird"}, configured=False)
    assert "logging.wandb.mode=" not in problem and "unset it (runs log offline then" in problem


def test_online_from_the_environment_without_a_key_names_the_variable(tmp_path, monkeypatch, capsys):
    """logging.wandb.mode left null and WANDB_MODE=online: the refusal names the variable, not a config
    key the user never set."""
    import pytest

    from megaframe.backends.registry import validate_for_engine
    from megaframe.config.compose import compose
    from megaframe.launch.checks import check_before_launch

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    cfg, _ = compose(["train.max_steps=1"])
    with pytest.raises(SystemExit) as refused:
        check_before_launch(cfg, validate_for_engine(cfg, 1), str(tmp_path / "run"))
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1, err
    assert "WANDB_MODE=online (in the environment) but no W&B key for api.wandb.ai" in err, err


def test_a_project_name_wandb_refuses_is_refused_before_launch_as_wandb_would():
    """'a/b c' or a 200-character name ended rank 0 after launch with W&B's UsageError, exit 1 (the
    code of a bug); WANDB_PROJECT too, which wandb checks whatever project megaframe passes
    (hostile review). Independent reference: wandb's own Settings."""
    from wandb.sdk.wandb_settings import Settings

    from megaframe.tracking.wandb_run import project_problem

    names = ["megaframe", "a/b c", "a:b", "x" * 128, "x" * 129, "ok-name_1.2", "100%", "q?", "h#", "back\\slash", ""]
    for name in names:
        try:
            Settings(project=name)
            accepted = True
        except Exception:
            accepted = False
        assert (project_problem(name, "offline", {}) is None) == accepted, name
        assert (project_problem(None, "online", {"WANDB_PROJECT": name}) is None) == accepted, name
    problem = project_problem("a/b c", "offline", {})
    assert problem.startswith("logging.wandb.project='a/b c': W&B refuses a project name that holds /") and \
        "\n" not in problem
    assert project_problem("a/b", "disabled", {"WANDB_PROJECT": "c:d"}) is None  # wandb never starts
    assert project_problem("fine", "offline", {"WANDB_PROJECT": "c:d"}).startswith("WANDB_PROJECT='c:d' (in the env")


def test_a_wandb_variable_wandb_refuses_is_named_before_launch():
    """WANDB_INIT_TIMEOUT=abc (metrics.md suggests WANDB_INIT_TIMEOUT=30), WANDB_SILENT=maybe or
    WANDB_RUN_ID=a/b ended rank 0 after launch: "ValidationError: 1 validation error for Settings",
    exit 1, naming nothing (hostile review)."""
    from megaframe.tracking.wandb_run import env_settings_problem

    for name, value, reason in (("WANDB_INIT_TIMEOUT", "abc", "Input should be a valid number"),
                                ("WANDB_SILENT", "maybe", "Input should be a valid boolean"),
                                ("WANDB_RUN_ID", "bad/id", "Run ID cannot contain")):
        problem = env_settings_problem("offline", {name: value, "WANDB_DIR": "/tmp"})
        assert problem.startswith(f"{name}={value!r} (in the environment): W&B refuses it ({reason}"), problem
        assert "\n" not in problem and "logging.wandb.mode=disabled" in problem
        assert env_settings_problem("disabled", {name: value}) is None  # wandb never starts
    assert env_settings_problem("offline", {"WANDB_INIT_TIMEOUT": "30", "WANDB_DIR": "/tmp", "WANDB_SILENT": "true"}) \
        is None
    assert env_settings_problem("online", {"WANDB_MODE": "weird", "WANDB_API_KEY": "x"}) is None  # checked apart
