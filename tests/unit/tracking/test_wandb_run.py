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
