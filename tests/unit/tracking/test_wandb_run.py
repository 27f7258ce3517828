"""A W&B server that cannot be reached (an outage, compute nodes without egress) or a refused key
does not end the run: rank 0 logs offline instead, in one warning line, under the same run id."""
from __future__ import annotations

from megaframe.config.schema import WandbConfig
from megaframe.tracking.wandb_run import WandbRun


def test_an_unreachable_server_leaves_the_run_logging_offline_under_its_id(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: connection refused
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")  # wandb's own setting (90 s by default)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = WandbRun(WandbConfig(mode="online"), tmp_path, {"lr": 1e-3})
    try:
        assert run.run.settings.mode == "offline"
        assert run.run.id == (tmp_path / "wandb_run_id").read_text().strip()  # `wandb sync` joins the same run
        run.log({"loss": 2.5}, step=1)
    finally:
        run.finish()
        import wandb

        wandb.teardown()  # its service's threads would be inherited by a later test's forked ranks
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("megaframe: warning: W&B did not start online (CommError")
    assert f"logging offline in {tmp_path / 'wandb'} instead" in warning[0]


def test_wandb_mode_in_the_environment_chooses_when_the_config_does_not(tmp_path, monkeypatch):
    """`WANDB_MODE=disabled megaframe-train` still wrote RUN_DIR/wandb and said `wandb sync`: the
    config's default (offline) was passed to wandb, which takes it over the variable. Now a
    logging.wandb.mode left null defers to WANDB_MODE as W&B reads it; one that is set wins."""
    from megaframe.tracking.wandb_run import wandb_mode

    modes = {None: "offline", "disabled": "disabled", "offline": "offline", "dryrun": "offline", "online": "online",
             "run": "online", "shared": "online"}
    for variable, mode in modes.items():
        assert wandb_mode(None, {} if variable is None else {"WANDB_MODE": variable}) == mode, variable
    assert wandb_mode("offline", {"WANDB_MODE": "disabled"}) == "offline"
    assert wandb_mode("disabled", {"WANDB_MODE": "online"}) == "disabled"

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = WandbRun(WandbConfig(), tmp_path, {"lr": 1e-3})  # the default: null
    assert run.run is None and run.sync_hint() is None and not (tmp_path / "wandb").exists()
